"""The DeepSeek-V3 family ("deepseek_v3"): MLA and multi-token prediction on the MoE GPT."""
from __future__ import annotations

from typing import Dict, Mapping

from moetrain.family import ColwiseParallel, Family, HeadShared, RegionOutput, SequenceParallel
from moetrain.registry import register_family

from moetrain.models.gpt import transformer_shape
from moetrain.models.moe_gpt import RECOMPUTE as MOE_GPT_RECOMPUTE, TP_PLAN as MOE_GPT_TP_PLAN, moe_arch
from moetrain.models.deepseek_v3 import hf
from moetrain.models.deepseek_v3.model import (DeepSeekV3, DeepSeekV3Config, MTPLayer,  # noqa: F401  (the family's API)
                                      MultiHeadLatentAttention)


def _as_mtp_block(plan: Mapping) -> Dict:
    """The `layers.*.` entries of `plan` for the multi-token-prediction blocks (`mtp.*.block.`)."""
    return {"mtp.*.block." + key[len("layers.*."):]: style for key, style in plan.items()
            if key.startswith("layers.*.")}


# MLA: the up-projections wq_b (wq without a query latent) and wkv_b give whole heads, column-wise;
# the down-projections, the latent norms and the shared RoPE key stay whole (each rank computes them;
# their gradient is summed over tp); wo is row-parallel (the GPT entry). The MTP blocks are split as
# the layers are, and an MTP depth's final norm feeds the vocabulary-parallel head as the model's
# does. Sequence parallelism with MTP is refused by moetrain.layout.
_LAYERS = {
    **MOE_GPT_TP_PLAN,
    "layers.*.attention.wq_a": HeadShared(),
    "layers.*.attention.q_norm": HeadShared(),
    "layers.*.attention.wq_b": ColwiseParallel(),
    "layers.*.attention.wkv_a": HeadShared(),
    "layers.*.attention.kv_norm": HeadShared(),
    "layers.*.attention.wkv_b": ColwiseParallel(),
}
TP_PLAN = {
    **_LAYERS,
    **_as_mtp_block(_LAYERS),
    "mtp.*.final_norm": (SequenceParallel(), RegionOutput()),
}
RECOMPUTE = {"full": ("layers.*", "mtp.*"),
             "selective": MOE_GPT_RECOMPUTE["selective"] + ("mtp.*.block.attention.core", "mtp.*.block.moe.experts")}


def mla_arch(cfg):
    """The planner's shape numbers: the MoE GPT's plus MLA's ranks and the MTP depth."""
    return dict(moe_arch(cfg), value_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                rope_dim=cfg.qk_rope_head_dim, mtp_depth=cfg.mtp_depth)


FAMILY = register_family(Family(
    name="deepseek_v3", config=DeepSeekV3Config, model=DeepSeekV3, tp_plan=TP_PLAN, recompute=RECOMPUTE,
    shape=transformer_shape, arch=mla_arch, hf=hf.FORMAT))
