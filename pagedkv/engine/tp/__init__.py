"""pagedkv.engine.tp: tensor parallelism over torch.distributed, one concept a module: shard (what each rank holds of a
model), collectives (the group's process groups, the model's collectives, the step-message transport),
step_message (one step's inputs packed into one tensor), workers (rank 0's worker processes, started
as `python -m pagedkv.engine.tp.worker`), group (forming the group: own workers or torchrun's), runners
(rank 0's runner, and the other ranks' serving loop), worker (a worker's entry point). May import the
library, engine.config, models, checkpoints and execution; never serving's llm_engine."""
