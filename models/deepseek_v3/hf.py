"""Hugging Face DeepSeek-V3 <-> `deepseek_v3`.

MLA's projections are renamed (`wq_a` <-> `q_a_proj`, `wkv_a` <-> `kv_a_proj_with_mqa`, ...), routed
experts sit under `mlp.` and the expert bias is `mlp.gate.e_score_correction_bias`. Multi-token-
prediction layer k sits at `model.layers.{num_hidden_layers + k}` in published checkpoints (its
`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, a full decoder layer, and copies of the embedding and
LM head, which moetrain shares: import checks that they are copies, export writes them).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from moetrain.family import HFFormat, MissingLayers, rename

from moetrain.models.gpt.hf import (Defaults, copy_reason, dense_mlp_maps, layer_maps, llama_config, llama_model_dict, refuse,
                           stack_maps, tied_head_copy)
from moetrain.models.moe_gpt.hf import check_moe_export, moe_maps, moe_section, refuse_export

DEFAULTS = {"deepseek_v3": Defaults(1e4, 1e-6)}
# aux-loss-free balancing: bias step per update (paper: 0.001) and sequence-wise aux loss
BIAS_UPDATE_RATE = 1e-3
SEQ_AUX_LOSS = 1e-4
ATTENTION = {"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj", "wq": "q_proj",
             "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}


def _to_model(hf: Dict[str, Any]) -> Dict[str, Any]:
    model, scaling = llama_model_dict(hf, "deepseek_v3", DEFAULTS[hf["model_type"]], yarn=True)
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        refuse(hf, "scoring_func", "DeepSeek-V3 routes with sigmoid scores")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        refuse(hf, "topk_method", "DeepSeek-V3 uses noaux_tc (group-limited top-k with the correction bias)")
    if hf.get("moe_layer_freq", 1) != 1:
        refuse(hf, "moe_layer_freq", "every layer after first_k_dense_replace is MoE in DeepSeek-V3")
    num_heads = hf["num_attention_heads"]
    model.update({
        "num_kv_heads": num_heads, "head_dim": hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
        "q_lora_rank": hf.get("q_lora_rank") or 0, "kv_lora_rank": hf["kv_lora_rank"],
        "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": hf["qk_rope_head_dim"],
        "v_head_dim": hf["v_head_dim"], "rope_interleave": bool(hf.get("rope_interleave", True)),
        "first_k_dense": hf.get("first_k_dense_replace", 0), "moe_layer_freq": 1,
        "mtp_depth": hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0,
        "moe": moe_section(
            num_experts=hf.get("n_routed_experts", hf.get("num_local_experts")), top_k=hf["num_experts_per_tok"],
            ffn_hidden_size=hf["moe_intermediate_size"], num_shared_experts=hf.get("n_shared_experts") or 0,
            score_func="sigmoid", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            route_scale=float(hf.get("routed_scaling_factor", 1.0)), num_groups=hf.get("n_group") or 1,
            topk_groups=hf.get("topk_group") or 1, group_score_topk=2, aux_loss_coeff=0.0,
            seq_aux_loss_coeff=float(hf.get("aux_loss_alpha", SEQ_AUX_LOSS)),
            bias_update_rate=BIAS_UPDATE_RATE)})
    if scaling:
        model.update(yarn_factor=float(scaling["factor"]),
                     yarn_original_max_positions=int(scaling["original_max_position_embeddings"]),
                     yarn_beta_fast=float(scaling.get("beta_fast") or 32), yarn_beta_slow=float(scaling.get("beta_slow") or 1),
                     yarn_mscale=float(scaling.get("mscale") or 0.0),
                     yarn_mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0))
        if scaling.get("attention_factor") is not None or scaling.get("truncate", True) is not True:
            refuse(hf, "rope_parameters", "YaRN with an explicit attention_factor or truncate: false is not implemented")
    return model


def _to_hf(cfg) -> Dict[str, Any]:
    if cfg.moe_layer_freq != 1:
        refuse_export("DeepSeek-V3", "moe_layer_freq", cfg.moe_layer_freq, "1: every layer after first_k_dense is MoE")
    moe = cfg.moe
    check_moe_export(cfg, "DeepSeek-V3", score_func=("sigmoid", "'sigmoid'"),
                     shared_ffn_hidden_size=(0, "0: n_shared_experts x moe_intermediate_size"))
    if moe.num_shared_experts < 1:
        refuse_export("DeepSeek-V3", "moe.num_shared_experts", moe.num_shared_experts, ">= 1")
    if moe.num_groups > 1 and moe.group_score_experts != 2:
        refuse_export("DeepSeek-V3", "moe.group_score_topk", moe.group_score_topk,
                      "2: HF scores a group by its top-2 experts")
    hf = llama_config(
        cfg, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], num_key_value_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, head_dim=cfg.qk_rope_head_dim, rope_interleave=cfg.rope_interleave,
        first_k_dense_replace=cfg.first_k_dense, num_nextn_predict_layers=cfg.mtp_depth,
        moe_intermediate_size=moe.ffn_hidden_size, n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k, n_shared_experts=moe.num_shared_experts,
        norm_topk_prob=moe.norm_topk_prob, routed_scaling_factor=moe.route_scale, n_group=moe.num_groups,
        topk_group=moe.topk_groups, scoring_func="sigmoid", topk_method="noaux_tc",
        aux_loss_alpha=moe.seq_aux_loss_coeff, attention_bias=False)
    if cfg.yarn is not None:
        hf["rope_scaling"] = {"type": "yarn", "rope_type": "yarn", "factor": cfg.yarn_factor,
                              "original_max_position_embeddings": cfg.yarn_original_max_positions,
                              "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow,
                              "mscale": cfg.yarn_mscale, "mscale_all_dim": cfg.yarn_mscale_all_dim}
    return hf


def _block(model, moe, ours, theirs, fused):
    used = ("wq_a", "q_norm", "wq_b") if model["q_lora_rank"] else ("wq",)
    maps = layer_maps(ours, theirs, {k: ATTENTION[k] for k in used + ("wkv_a", "kv_norm", "wkv_b", "wo")})
    if not moe:
        return maps + dense_mlp_maps(ours, theirs)
    bias = rename(ours + "moe.expert_bias", theirs + "mlp.gate.e_score_correction_bias")
    return maps + moe_maps(model, ours, theirs + "mlp.", fused, bias=bias)


def _tensor_maps(model, cfg, fused_layers):
    """The stack, then every MTP depth; copies: each depth's embedding and head, which moetrain shares."""
    maps = stack_maps(model, cfg, fused_layers, _block)
    head = "embed.weight" if model["tie_embeddings"] else "lm_head.weight"
    copies = {}
    for k in range(model.get("mtp_depth", 0)):
        ours, theirs = f"mtp.{k}.", f"model.layers.{model['num_layers'] + k}."
        maps += [rename(ours + "enorm.weight", theirs + "enorm.weight"),
                 rename(ours + "hnorm.weight", theirs + "hnorm.weight"),
                 rename(ours + "eh_proj.weight", theirs + "eh_proj.weight"),
                 rename(ours + "final_norm.weight", theirs + "shared_head.norm.weight")]
        maps += _block(model, True, ours + "block.", theirs, fused_layers(theirs))
        copies.update({theirs + "embed_tokens.weight": "embed.weight", theirs + "shared_head.head.weight": head})
    return maps, copies


def _missing_mtp_layers(model: Dict[str, Any], hf_names) -> Optional[MissingLayers]:
    """The MTP depths config.json promises (`num_nextn_predict_layers`) past the ones the checkpoint
    holds (`model.layers.{L + k}.eh_proj`): transformers' model has no MTP layer, so `save_pretrained`
    writes none while its config.json keeps the number."""
    promised, present = model.get("mtp_depth", 0), 0
    while present < promised and f"model.layers.{model['num_layers'] + present}.eh_proj.weight" in hf_names:
        present += 1
    if present == promised:
        return None
    return MissingLayers(held=dict(model, mtp_depth=present),
                         prefixes=tuple(f"mtp.{k}." for k in range(present, promised)),
                         what=f"config.json has num_nextn_predict_layers={promised} but the checkpoint holds "
                              f"{present} MTP layer(s) (transformers' save_pretrained writes none)")


FORMAT = HFFormat(model_types=tuple(DEFAULTS), to_model=_to_model, to_hf=_to_hf, tensor_maps=_tensor_maps,
                  import_copies=tied_head_copy, copy_reason=copy_reason, missing_layers=_missing_mtp_layers)
