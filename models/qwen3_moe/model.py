"""Qwen3-MoE ("qwen3_moe"): the MoE GPT with per-head q/k RMSNorm and Qwen's MoE layer placement.

Against `moe_gpt`:
* attention normalises every query and key head (`q_norm`, `k_norm`: RMSNorm over `head_dim`, one
  weight shared by the heads) before RoPE; `head_dim` is its own key (Qwen3-30B-A3B: hidden 2048,
  32 heads of 128);
* layer i is MoE unless it is in `mlp_only_layers`, and only when `(i + 1) % decoder_sparse_step
  == 0` (HF Qwen3-MoE); the other layers are dense SwiGLU of `ffn_hidden_size`. `first_k_dense`
  and `moe_layer_freq` are not used (left at 0 and 1);
* routing is `moe:` as configured; Qwen3-MoE is softmax top-k with `norm_topk_prob`.

Parameter names are `moe_gpt`'s plus `layers.{i}.attention.{q_norm,k_norm}.weight [head_dim]`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from mindspore import nn

from moetrain.models.gpt.model import TransformerBlock
from moetrain.models.moe_gpt.model import MoEBlock, MoEGPT, MoEGPTConfig
from moetrain.layers import Attention, RMSNorm, tensor_dtype


@dataclass(kw_only=True)
class Qwen3MoEConfig(MoEGPTConfig):
    name: str = "qwen3_moe"
    decoder_sparse_step: int = 1          # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: List[int] = field(default_factory=list)   # ... and i is not listed here

    def __post_init__(self):
        super().__post_init__()
        if self.first_k_dense != 0 or self.moe_layer_freq != 1:
            raise ValueError("model.first_k_dense / model.moe_layer_freq: qwen3_moe places its MoE layers with "
                             "decoder_sparse_step and mlp_only_layers (HF names); leave these at 0 and 1")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"model.decoder_sparse_step: must be >= 1, got {self.decoder_sparse_step}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"model.mlp_only_layers: {bad} are not layer indices in [0, {self.num_layers})")
        if not self.moe_layers:
            raise ValueError("model.decoder_sparse_step / mlp_only_layers leave no MoE layer (use model.name: gpt "
                             "for a dense model)")

    def is_moe_layer(self, index: int) -> bool:
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0


class QKNormAttention(Attention):
    """Grouped-query attention with RMSNorm on each query and key head before RoPE (Qwen3)."""

    def __init__(self, cfg: Qwen3MoEConfig):
        super().__init__(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.seq_length,
                         cfg.rope_theta, cfg.init_std, cfg.output_init_std, cfg.compute_dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def project(self, x):
        q = self.q_norm(self.heads(self.wq, x)).astype(tensor_dtype(self.wq.compute_dtype))
        k = self.k_norm(self.heads(self.wk, x)).astype(tensor_dtype(self.wk.compute_dtype))
        return q, k, self.heads(self.wv, x)


class Qwen3MoE(MoEGPT):
    """`construct(input_ids, labels) -> (loss, stats)` exactly as `moe_gpt`."""

    def build_block(self, layer_index: int) -> nn.Cell:
        attention = QKNormAttention(self.cfg)
        if self.cfg.is_moe_layer(layer_index):
            return MoEBlock(self.cfg, attention)
        return TransformerBlock(self.cfg, attention)
