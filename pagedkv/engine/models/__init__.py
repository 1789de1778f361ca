"""pagedkv.engine.models: one module per architecture (llama, gemma2, qwen3, gemma3, gpt_oss, deepseek_v3) over
the shared decoder blocks (layers), and the registry that maps a checkpoint's architecture name to its class
(registry). May import the library (pagedkv, pagedkv.ops) and engine.config; never the checkpoints, serving,
execution, kv or tp rooms."""
