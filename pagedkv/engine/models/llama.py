"""Llama-family decoder (RMSNorm, RoPE incl. Llama-3 scaling, GQA, SwiGLU) on layers.py's blocks.
Mistral is this model with a sliding window on every layer; gemma2.py builds Gemma 2 from the same blocks."""
import torch
from torch import nn

from ..config import ModelConfig
from .layers import AttentionMetadata, DecoderLayer, RMSNorm, RotaryEmbedding, VocabParallelEmbedding


class LlamaModel(nn.Module):
    decoder_layer, norm_class = DecoderLayer, RMSNorm     # what a variant (gemma2.py) replaces

    def __init__(self, cfg: ModelConfig, tp=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if tp is None else \
            VocabParallelEmbedding(cfg, tp)
        self.layers = nn.ModuleList(self.decoder_layer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)
        self.layer_ropes = [self.rotary_emb] * cfg.num_layers     # each layer's rope (Gemma 3 has two)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta):
        """Final hidden states of the last token of every sequence: [B, hidden].

        Submodules are called through `.forward`: the hot path skips nn.Module.__call__ (hooks,
        about 7 us a call), a tenth of a CPU decode step of a small model."""
        h, residual = self.embed(input_ids), None
        loads = meta.layer_loads
        for i, (layer, kv_cache, rope) in enumerate(zip(self.layers, kv_caches, self.layer_ropes)):
            if loads is not None:
                loads.wait(i)
            h, residual = layer.forward(positions, h, residual, rope, kv_cache, meta)
        if meta.logits_indices is not None:            # speculative verification: several per sequence
            h, residual = h[meta.logits_indices], residual[meta.logits_indices]
        elif h.shape[0] != meta.seq_lens.shape[0]:     # some sequence has several tokens: keep the last
            last = meta.query_start_loc[1:].long() - 1
            h, residual = h[last], residual[last]
        return self.norm.forward(h, residual)


class LlamaForCausalLM(nn.Module):
    model_class = LlamaModel
    # Checkpoint names packed into one of our fused projections: name -> (fused name, shard index).
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, tp=None):
        """tp: a pagedkv.engine.tp.collectives.TensorParallel to build this rank's shard (config then holds the
        shard's head and MLP sizes; embedding and LM head hold its rows of the vocabulary)."""
        super().__init__()
        self.tp = tp
        if tp is not None:
            cfg = tp.shard.local_config(cfg)
        self.config = cfg
        self.model = self.model_class(cfg, tp)
        vocab_rows = cfg.vocab_size if tp is None else tp.shard.vocab_rows(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab_rows, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def unused_checkpoint_tensor(self, name: str) -> bool:
        """A checkpoint tensor the model does not run and the loader skips (DeepSeek V3's MTP layers)."""
        return False

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the last token of every sequence: [B, hidden]."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """[B, vocab] float32 logits (under tensor parallelism: on rank 0; None on the others)."""
        logits = self.lm_head(h)
        if self.tp is not None:
            logits = self.tp.gather_logits(logits, self.config.vocab_size)
        if logits is None:
            return None
        cap = self.config.final_logit_softcapping
        if cap is not None:                  # Gemma 2: in the model's dtype, as transformers
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
