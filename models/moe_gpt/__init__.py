"""The Mixtral-style MoE GPT family ("moe_gpt"): the GPT's plans with MoE layers replicated over tp."""
from __future__ import annotations

from typing import Any, Dict

from moetrain.family import ColwiseParallel, Family, RegionInput, RowwiseParallel, WholeSequence
from moetrain.registry import register_family

from moetrain.models.gpt import TP_PLAN as GPT_TP_PLAN, transformer_arch, transformer_shape
from moetrain.models.moe_gpt import hf
from moetrain.models.moe_gpt.model import MoEBlock, MoEGPT, MoEGPTConfig  # noqa: F401  (the family's API)

# MoE layers are replicated over tp (router and experts on every tp rank, on the whole sequence, so
# routing, capacity and aux losses equal one process); the shared experts are split inside them.
TP_PLAN = {
    **GPT_TP_PLAN,
    "layers.*.moe": WholeSequence(),
    "layers.*.moe.shared_experts": RegionInput(sequence=False),
    "layers.*.moe.shared_experts.w_gate": ColwiseParallel(),
    "layers.*.moe.shared_experts.w_up": ColwiseParallel(),
    "layers.*.moe.shared_experts.w_down": RowwiseParallel(sequence=False),
}

RECOMPUTE = {"full": ("layers.*",), "selective": ("layers.*.attention.core", "layers.*.moe.experts")}


def moe_arch(cfg) -> Dict[str, Any]:
    """The planner's shape numbers of a MoE GPT config: the GPT's plus the MoE layers'."""
    moe = cfg.moe
    return dict(transformer_arch(cfg), moe_layers=tuple(cfg.moe_layers), experts=moe.num_experts, top_k=moe.top_k,
                expert_ffn=moe.ffn_hidden_size, shared_ffn=moe.shared_hidden_size,
                capacity_factor=float(moe.capacity_factor),
                groups=getattr(moe, "num_groups", 1), topk_groups=getattr(moe, "topk_groups", 1))


FAMILY = register_family(Family(
    name="moe_gpt", config=MoEGPTConfig, model=MoEGPT, tp_plan=TP_PLAN, recompute=RECOMPUTE, shape=transformer_shape,
    arch=moe_arch, hf=hf.FORMAT))
