"""The Qwen3-MoE family ("qwen3_moe"): the MoE GPT's plans, per-head q/k norms on this rank's heads."""
from __future__ import annotations

from moetrain.family import Family, HeadShared
from moetrain.registry import register_family

from moetrain.models.gpt import transformer_shape
from moetrain.models.moe_gpt import RECOMPUTE, TP_PLAN as MOE_GPT_TP_PLAN, moe_arch
from moetrain.models.qwen3_moe import hf
from moetrain.models.qwen3_moe.model import QKNormAttention, Qwen3MoE, Qwen3MoEConfig  # noqa: F401  (the family's API)

# the per-head q/k norms (one weight over head_dim) run on this rank's heads
TP_PLAN = {
    **MOE_GPT_TP_PLAN,
    "layers.*.attention.q_norm": HeadShared(),
    "layers.*.attention.k_norm": HeadShared(),
}

FAMILY = register_family(Family(
    name="qwen3_moe", config=Qwen3MoEConfig, model=Qwen3MoE, tp_plan=TP_PLAN, recompute=RECOMPUTE,
    shape=transformer_shape, arch=lambda cfg: dict(moe_arch(cfg), qk_norm=True), hf=hf.FORMAT))
