"""pagedkv.engine.checkpoints: reading models from disk: Hugging Face safetensors folders and GGUF files
into the registry's model class (loader, gguf), tokenizers and chat templates (chat). May import the
library, engine.config, the model registry (models.registry) and the tensor-parallel shard plan
(tp.shard); never a model module's internals, serving or execution."""
