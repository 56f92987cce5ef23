"""The dense Llama-style GPT family ("gpt"): its model, parallel plans, planner shape and HF format.

The transformer pieces here (the plan, `transformer_shape`, `transformer_arch`) are what the other
transformer families extend.
"""
from __future__ import annotations

from typing import Any, Dict

from moetrain.family import (ColwiseParallel, Family, RegionInput, RegionOutput, RowwiseParallel, SequenceParallel,
                             Upcycling, VocabParallel)
from moetrain.layout import ModelShape
from moetrain.registry import register_family

from moetrain.models.gpt import hf, upcycle
from moetrain.models.gpt.model import GPT, GPTConfig, TransformerBlock, build_attention  # noqa: F401  (the family's API)

# Attention and MLP are tensor-parallel regions between sequence-parallel norms.
TP_PLAN = {
    "embed": VocabParallel(),
    "layers.*.attention_norm": SequenceParallel(),
    "layers.*.attention": RegionInput(),
    "layers.*.attention.wq": ColwiseParallel(),
    "layers.*.attention.wk": ColwiseParallel(),
    "layers.*.attention.wv": ColwiseParallel(),
    "layers.*.attention.wo": RowwiseParallel(),
    "layers.*.ffn_norm": SequenceParallel(),
    "layers.*.mlp": RegionInput(),
    "layers.*.mlp.w_gate": ColwiseParallel(),
    "layers.*.mlp.w_up": ColwiseParallel(),
    "layers.*.mlp.w_down": RowwiseParallel(),
    "final_norm": (SequenceParallel(), RegionOutput()),
    "lm_head": ColwiseParallel(),
    "cross_entropy": VocabParallel(),
}

# Cells to recompute per policy (module path patterns): whole blocks, or the attention core.
RECOMPUTE = {"full": ("layers.*",), "selective": ("layers.*.attention.core",)}


def transformer_shape(cfg) -> ModelShape:
    """The sizes a layout must divide, of a config with the GPT keys (and a `moe` section, MoE layers
    and an MTP depth where the family has them)."""
    moe = getattr(cfg, "moe", None)
    moe_layers = list(getattr(cfg, "moe_layers", None) or [])
    return ModelShape(layers=cfg.num_layers, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads or cfg.num_heads,
                      vocab=cfg.vocab_size, ffn=cfg.ffn_hidden_size if len(moe_layers) < cfg.num_layers else None,
                      experts=moe.num_experts if moe is not None else 0,
                      shared_ffn=moe.shared_hidden_size if moe is not None else 0,
                      expert_ffn=moe.ffn_hidden_size if moe is not None else 0,
                      mtp_depth=getattr(cfg, "mtp_depth", 0) or 0)


def transformer_arch(cfg) -> Dict[str, Any]:
    """The planner's shape numbers (`moetrain.planner.arch.Arch` fields) of a dense GPT config."""
    return dict(vocab=cfg.vocab_size, hidden=cfg.hidden_size, layers=cfg.num_layers, heads=cfg.num_heads,
                kv_heads=cfg.num_kv_heads or cfg.num_heads, head_dim=cfg.head_dim, ffn=cfg.ffn_hidden_size,
                tied=cfg.tie_embeddings)


FAMILY = register_family(Family(
    name="gpt", config=GPTConfig, model=GPT, tp_plan=TP_PLAN, recompute=RECOMPUTE, shape=transformer_shape,
    arch=transformer_arch, hf=hf.FORMAT, upcycle=Upcycling(upcycle.upcycled_section, upcycle.upcycled_state)))
