"""Mixture-of-Experts GPT ("moe_gpt"): the GPT blocks with MoE feed-forward layers.

Layer `i` is MoE when `i >= first_k_dense` and `(i - first_k_dense) % moe_layer_freq == 0`
(Mixtral: every layer; DeepSeek: dense first layers), dense SwiGLU otherwise. The MoE layer
sees the normed hidden state of all `[B, S, H]` tokens (sequence boundaries feed the sequence aux loss); its parameters live under
`layers.{i}.moe.*` (router.weight, experts.w_gate/w_up/w_down, shared_experts.*, expert_bias).

`construct` returns `loss = lm_loss + sum over MoE layers of (coeff * aux term)` and stats:
    lm_loss, aux_loss, seq_aux_loss, z_loss   unweighted aux terms summed over MoE layers, so
                                              loss = lm_loss + Σ_term coeff_term * stats[term]
    expert_load  [num_moe_layers, E]          tokens routed to each expert
    dropped, routed                           token-expert assignments dropped / routed, all layers
    expert_rows                               rows the expert GEMMs computed, all layers
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import numpy as np

import mindspore as ms
from mindspore import nn, ops

from models.gpt import GPT, GPTConfig, TransformerBlock, build_attention
from moetrain.layers import RMSNorm, compute_dtype_of
from moetrain.moe.config import MoEConfig
from moetrain.moe.layer import MoELayer, update_expert_bias
from moetrain.registry import register_model

AUX_TERMS = ("aux_loss", "seq_aux_loss", "z_loss")
COUNT_TERMS = ("dropped", "routed", "expert_rows")


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
    """Pre-norm attention + MoE block. `construct(x [B, S, H])` -> `(x, moe_stats)`."""

    def __init__(self, cfg: MoEGPTConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = build_attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.moe = MoELayer(cfg.hidden_size, cfg.moe, init_std=cfg.init_std,
                            compute_dtype=compute_dtype_of(cfg.compute_dtype))

    def construct(self, x):
        h = x + self.attention(self.attention_norm(x)).astype(ms.float32)
        y, stats = self.moe(self.ffn_norm(h))
        return h + y.astype(ms.float32), stats


@register_model("moe_gpt", config=MoEGPTConfig)
class MoEGPT(GPT):
    """GPT with MoE layers; see the module docstring for the loss and stats."""

    def __init__(self, cfg: MoEGPTConfig):
        super().__init__(cfg)
        self.moe_layer_indices = tuple(cfg.moe_layers)

    def build_block(self, layer_index: int) -> nn.Cell:
        return MoEBlock(self.cfg) if self.cfg.is_moe_layer(layer_index) else TransformerBlock(self.cfg)

    def forward_with_stats(self, input_ids):
        """`(logits, moe_stats, weighted_aux)` where weighted_aux = Σ_layers coeff·aux terms."""
        self.check_length(input_ids)
        h = self.embed(input_ids)
        zero = ops.zeros((), ms.float32)
        totals = {term: zero for term in AUX_TERMS + COUNT_TERMS}
        weighted_aux = zero
        loads = []
        for index in range(len(self.layers)):
            if index in self.moe_layer_indices:
                h, stats = self.layers[index](h)
                for term in AUX_TERMS + COUNT_TERMS:
                    totals[term] = totals[term] + stats[term].astype(ms.float32)
                weighted_aux = weighted_aux + self.layers[index].moe.weighted_aux(stats)
                loads.append(stats["expert_load"].astype(ms.float32))
            else:
                h = self.layers[index](h)
        totals["expert_load"] = ops.stack(loads)
        return self.output_logits(h), totals, weighted_aux

    def logits(self, input_ids):
        return self.forward_with_stats(input_ids)[0]

    def construct(self, input_ids, labels):
        logits, stats, weighted_aux = self.forward_with_stats(input_ids)
        lm_loss = self.cross_entropy(logits, labels)
        stats["lm_loss"] = lm_loss
        return lm_loss + weighted_aux, stats

    def moe_modules(self):
        """The MoE layer cells, in layer order (row `j` of `expert_load` is `moe_modules()[j]`)."""
        return [self.layers[i].moe for i in self.moe_layer_indices]

    def update_expert_bias(self, expert_load: np.ndarray) -> None:
        """Aux-loss-free balancing (DeepSeek-V3), outside the gradient: nudge every MoE layer's
        `expert_bias` from its row of `expert_load [num_moe_layers, E]` (token counts)."""
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
