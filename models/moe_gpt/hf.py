"""Hugging Face Mixtral <-> `moe_gpt`, and the MoE pieces the other MoE families' formats share.

HF routed experts come in two layouts, both read:

    per_expert (published checkpoints;       Mixtral   block_sparse_moe.gate.weight            [E, H]
      what transformers 5 writes on save)              block_sparse_moe.experts.{j}.w1/w3.weight [F, H], w2 [H, F]
                                             others    mlp.gate.weight, mlp.experts.{j}.{gate,up,down}_proj.weight
    fused (transformers 5 in memory)         all       mlp.gate.weight                          [E, H]
                                                       mlp.experts.gate_up_proj  [E, 2F, H] (gate rows, then up)
                                                       mlp.experts.down_proj     [E, H, F]

moetrain keeps experts as `moe.experts.w_gate / w_up [E, H, F]`, `w_down [E, F, H]`, so conversion
transposes each expert matrix.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from moetrain.family import HFFormat, TensorMap, experts_fused, experts_per_expert, rename, unbiased_routing

from moetrain.models.gpt.hf import (ATTENTION, SWIGLU, Defaults, copy_reason, dense_mlp_maps, layer_maps, llama_config,
                           llama_model_dict, stack_maps, tied_head_copy)

DEFAULTS = {"mixtral": Defaults(1e6, 1e-5)}


def moe_section(**keys) -> Dict[str, Any]:
    """A Mixtral-style `moe:` section (softmax, renormalised top-k, dropless) with `keys` replaced."""
    moe = {"num_shared_experts": 0, "score_func": "softmax", "norm_topk_prob": True, "route_scale": 1.0,
           "num_groups": 1, "topk_groups": 1, "capacity_factor": 0.0}
    moe.update(keys)
    return moe


def refuse_export(family: str, key: str, value, want: str):
    raise ValueError(f"model.{key}={value!r} cannot be expressed in the {family} format (needs {want})")


def check_moe_export(cfg, family: str, **want) -> None:
    """Refuse MoE settings `family` cannot express; `want`: moe key -> (required value, why)."""
    for key, (value, why) in want.items():
        if getattr(cfg.moe, key) != value:
            refuse_export(family, f"moe.{key}", getattr(cfg.moe, key), why)


def moe_maps(model: Dict[str, Any], ours: str, hf_moe: str, fused: bool, expert_names=("gate_proj", "up_proj", "down_proj"),
             bias: Optional[TensorMap] = None, family: str = "") -> List[TensorMap]:
    """A MoE layer under `hf_moe`: router, routed experts (per-expert `expert_names` or fused), shared
    experts, then the expert bias (`bias`, or zeros that must stay zero: `family` has none)."""
    experts = model["moe"]["num_experts"]
    maps = [rename(ours + "moe.router.weight", hf_moe + "gate.weight")]
    if fused:
        maps.append(experts_fused(ours + "moe.experts.", hf_moe + "experts.", model["moe"]["ffn_hidden_size"]))
    else:
        maps.append(experts_per_expert(ours + "moe.experts.", hf_moe + "experts.", experts, expert_names))
    if model["moe"]["num_shared_experts"]:
        maps += [rename(f"{ours}moe.shared_experts.{k}.weight", f"{hf_moe}shared_experts.{v}.weight")
                 for k, v in SWIGLU.items()]
    maps.append(bias if bias is not None else unbiased_routing(ours + "moe.expert_bias", experts, family))
    return maps


def _to_model(hf: Dict[str, Any]) -> Dict[str, Any]:
    model, _ = llama_model_dict(hf, "moe_gpt", DEFAULTS[hf["model_type"]])
    model.update(first_k_dense=0, moe_layer_freq=1, moe=moe_section(
        num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], ffn_hidden_size=hf["intermediate_size"],
        aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001))))
    return model


def _to_hf(cfg) -> Dict[str, Any]:
    if cfg.first_k_dense != 0:
        refuse_export("Mixtral", "first_k_dense", cfg.first_k_dense, "0: every layer is MoE")
    if cfg.moe_layer_freq != 1:
        refuse_export("Mixtral", "moe_layer_freq", cfg.moe_layer_freq, "1: every layer is MoE")
    check_moe_export(cfg, "Mixtral", num_shared_experts=(0, "0"), score_func=("softmax", "'softmax'"),
                     norm_topk_prob=(True, "true: Mixtral renormalises the top-k weights"), route_scale=(1.0, "1.0"),
                     num_groups=(1, "1: no group-limited routing"))
    moe = cfg.moe
    return llama_config(cfg, model_type="mixtral", architectures=["MixtralForCausalLM"],
                        intermediate_size=moe.ffn_hidden_size, num_local_experts=moe.num_experts,
                        num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_coeff,
                        output_router_logits=False, router_jitter_noise=0.0, sliding_window=None)


def _block(model, moe, ours, theirs, fused):
    maps = layer_maps(ours, theirs, ATTENTION)
    if not moe:
        return maps + dense_mlp_maps(ours, theirs)
    if fused:
        return maps + moe_maps(model, ours, theirs + "mlp.", True, family="Mixtral")
    return maps + moe_maps(model, ours, theirs + "block_sparse_moe.", False, ("w1", "w3", "w2"), family="Mixtral")


FORMAT = HFFormat(model_types=tuple(DEFAULTS), to_model=_to_model, to_hf=_to_hf,
                  tensor_maps=lambda model, cfg, fused_layers: (stack_maps(model, cfg, fused_layers, _block), {}),
                  import_copies=tied_head_copy, copy_reason=copy_reason)
