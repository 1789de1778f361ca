"""pagedkv.engine.kv: the engine's KV beyond the device pool: the disk tier (disk_tier), KV transfer between
engines (transfer), the KV fingerprint that says two caches hold the same format (identity), KV events
(events) and fp8 KV scales (quant). May import the library and engine.config; never models, checkpoints
or execution (transfer alone drives an LLM, so it may import serving)."""
