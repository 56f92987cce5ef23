"""Mixture-of-Experts GPT ("moe_gpt"): the GPT blocks with MoE feed-forward layers.

Layer `i` is MoE when `i >= first_k_dense` and `(i - first_k_dense) % moe_layer_freq == 0`
(Mixtral: every layer; DeepSeek: dense first layers), dense SwiGLU otherwise. The MoE layer
sees the normed hidden state of all `[B, S, H]` tokens (sequence boundaries feed the sequence aux loss); its parameters live under
`layers.{i}.moe.*` (router.weight, experts.w_gate/w_up/w_down, shared_experts.*, expert_bias).

`construct` (the GPT's, through its pieces) returns `loss = lm_loss + sum over MoE layers of
(coeff * aux term)` and the MoE layers' stats (`MoELayer.stat_specs`):
    lm_loss, aux_loss, seq_aux_loss, z_loss   unweighted aux terms summed over MoE layers, so
                                              loss = lm_loss + Σ_term coeff_term * stats[term]
    expert_load  [num_moe_layers, E]          tokens routed to each expert, one row per MoE layer
    dropped, routed                           token-expert assignments dropped / routed, all layers
    expert_rows                               rows the expert GEMMs computed, all layers
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

import mindspore as ms
from mindspore import nn, ops

from moetrain.models.gpt.model import GPT, GPTConfig, TransformerBlock, build_attention
from moetrain.layers import RMSNorm, compute_dtype_of, fp32
from moetrain.moe.config import MoEConfig
from moetrain.modeling import reused_block
from moetrain.moe.layer import MoELayer, moe_stat_specs, update_expert_bias



@dataclass(kw_only=True)
class MoEGPTConfig(GPTConfig):
    name: str = "moe_gpt"
    moe: MoEConfig = field(default_factory=MoEConfig)
    first_k_dense: int = 0               # the first k layers are dense (DeepSeek)
    moe_layer_freq: int = 1              # after those, every k-th layer is MoE (Mixtral: 1)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)
        if not 0 <= self.first_k_dense < self.num_layers:
            raise ValueError(f"model.first_k_dense: must be in [0, num_layers={self.num_layers}) so that at "
                             f"least one layer is MoE, got {self.first_k_dense} (use model.name: gpt for a "
                             f"dense model)")
        if self.moe_layer_freq < 1:
            raise ValueError(f"model.moe_layer_freq: must be >= 1, got {self.moe_layer_freq}")

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense and (index - self.first_k_dense) % self.moe_layer_freq == 0

    @property
    def moe_layers(self) -> List[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]


class MoEBlock(nn.Cell):
    """Pre-norm attention + MoE block. `construct(x [B, S, H], context=None)` -> `(x, moe_stats)`; the
    stats and how they combine are the MoE layer's (`MoELayer.stat_specs`); `context`: packed
    documents for the attention, or None."""

    returns_stats = True

    @reused_block
    def __init__(self, cfg: MoEGPTConfig, attention: Optional[nn.Cell] = None):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = attention if attention is not None else build_attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.moe = MoELayer(cfg.hidden_size, cfg.moe, init_std=cfg.init_std,
                            compute_dtype=compute_dtype_of(cfg.compute_dtype))

    @property
    def stat_specs(self):
        return self.moe.stat_specs

    def weighted_aux(self, stats):
        return self.moe.weighted_aux(stats)

    def construct(self, x, context=None):
        h = x + self.attention(self.attention_norm(x), context).astype(ms.float32)
        y, stats = self.moe(self.ffn_norm(h))
        return h + y.astype(ms.float32), stats

    def counting(self, x, context, valid: int):
        """`construct` with only the first `valid` positions of each sequence counted in the MoE
        stats (`MoELayer.construct`); a method beside `construct`, which stays the one graph every
        layer reuses (`reused_block`). DeepSeek-V3's MTP under context parallelism calls it."""
        h = x + self.attention(self.attention_norm(x), context).astype(ms.float32)
        y, stats = self.moe(self.ffn_norm(h), valid)
        return h + y.astype(ms.float32), stats

    def decode(self, x, step, past=None):
        """Incremental decoding (PyNative, `moetrain.kv_cache`): `(x, present)`; the MoE layer routes
        as in training (`MoELayer.decode`), without stats."""
        attended, present = self.attention.decode(self.attention_norm(x), step, past)
        h = x + fp32(attended)
        return h + fp32(self.moe.decode(self.ffn_norm(h))), present


class MoEGPT(GPT):
    """GPT with MoE layers; see the module docstring for the loss and stats."""

    def build_block(self, layer_index: int) -> nn.Cell:
        return MoEBlock(self.cfg) if self.cfg.is_moe_layer(layer_index) else TransformerBlock(self.cfg)

    def block_returns_stats(self, layer_index: int) -> bool:
        return self.cfg.is_moe_layer(layer_index)

    def whole_layer_stat_specs(self):
        return moe_stat_specs(self.cfg.moe.num_experts)

    def moe_modules(self):
        """The MoE layers this model holds, in layer order (row `j` of its `expert_load`)."""
        return [block.moe for block in self.layers if block.returns_stats]

    def update_expert_bias(self, expert_load: np.ndarray) -> None:
        """Aux-loss-free balancing (DeepSeek-V3), outside the gradient: nudge every MoE layer this
        model holds from its row of `expert_load [num_moe_layers, E]` (token counts; a pipeline stage
        passes its own rows)."""
        expert_load = np.asarray(expert_load)
        layers = self.moe_modules()
        if expert_load.shape != (len(layers), self.cfg.moe.num_experts):
            raise ValueError(f"expert_load has shape {expert_load.shape}, expected "
                             f"(num_moe_layers={len(layers)}, num_experts={self.cfg.moe.num_experts})")
        for layer, load in zip(layers, expert_load):
            new_bias = update_expert_bias(layer.expert_bias.asnumpy(), load, self.cfg.moe.bias_update_rate)
            # ops.assign, not set_data: a jitted step compiled earlier keeps reading the old data after
            # set_data (MindSpore 2.10, measured), so the balancing would never reach the routing
            ops.assign(layer.expert_bias, ms.Tensor(new_bias, ms.float32))
