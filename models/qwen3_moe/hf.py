"""Hugging Face Qwen3-MoE <-> `qwen3_moe`: Mixtral's tensors under `mlp.` with `{gate,up,down}_proj`
expert names, plus the per-head `self_attn.{q_norm,k_norm}`."""
from __future__ import annotations

from typing import Any, Dict

from moetrain.family import HFFormat

from moetrain.models.gpt.hf import (ATTENTION, Defaults, copy_reason, dense_mlp_maps, layer_maps, llama_config, llama_model_dict,
                           stack_maps, tied_head_copy)
from moetrain.models.moe_gpt.hf import check_moe_export, moe_maps, moe_section

DEFAULTS = {"qwen3_moe": Defaults(1e4, 1e-6, use_sliding_window=False)}
QK_NORM_ATTENTION = dict(ATTENTION, q_norm="q_norm", k_norm="k_norm")


def _to_model(hf: Dict[str, Any]) -> Dict[str, Any]:
    model, _ = llama_model_dict(hf, "qwen3_moe", DEFAULTS[hf["model_type"]])
    model.update(decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                 mlp_only_layers=list(hf.get("mlp_only_layers") or []),
                 moe=moe_section(num_experts=hf.get("num_experts", hf.get("num_local_experts")),
                                 top_k=hf["num_experts_per_tok"], ffn_hidden_size=hf["moe_intermediate_size"],
                                 norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                                 aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001))))
    return model


def _to_hf(cfg) -> Dict[str, Any]:
    check_moe_export(cfg, "Qwen3-MoE", num_shared_experts=(0, "0"), score_func=("softmax", "'softmax'"),
                     route_scale=(1.0, "1.0"), num_groups=(1, "1: no group-limited routing"))
    moe = cfg.moe
    return llama_config(cfg, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                        moe_intermediate_size=moe.ffn_hidden_size, num_experts=moe.num_experts,
                        num_experts_per_tok=moe.top_k, norm_topk_prob=moe.norm_topk_prob,
                        decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
                        router_aux_loss_coef=moe.aux_loss_coeff, output_router_logits=False, attention_bias=False,
                        use_sliding_window=False, sliding_window=None)


def _block(model, moe, ours, theirs, fused):
    maps = layer_maps(ours, theirs, QK_NORM_ATTENTION)
    if not moe:
        return maps + dense_mlp_maps(ours, theirs)
    return maps + moe_maps(model, ours, theirs + "mlp.", fused, family="Qwen3-MoE")


FORMAT = HFFormat(model_types=tuple(DEFAULTS), to_model=_to_model, to_hf=_to_hf,
                  tensor_maps=lambda model, cfg, fused_layers: (stack_maps(model, cfg, fused_layers, _block), {}),
                  import_copies=tied_head_copy, copy_reason=copy_reason)
