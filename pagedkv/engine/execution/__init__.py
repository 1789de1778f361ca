"""pagedkv.engine.execution: running the model on one rank: the model runner (block moves, attention inputs,
forward, sampling) and the CPU weight packing (cpu_linear). May import the library, engine.config, models,
checkpoints, kv and serving's data types (scheduler batches, sampling, speculation); never llm_engine."""
