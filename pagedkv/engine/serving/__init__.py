"""pagedkv.engine.serving: the LLM API (llm_engine), requests and sequences (sequence), the scheduler,
sampling, speculative decoding and metrics. May import the library, engine.config, kv, checkpoints and
(llm_engine only) execution and tp; never a model module: models are reached through execution."""
