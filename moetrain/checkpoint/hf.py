"""Hugging Face interchange: Llama/Mistral <-> `gpt`, Mixtral <-> `moe_gpt`, DeepSeek-V3 <->
`deepseek_v3`, Qwen3-MoE <-> `qwen3_moe`.

    moetrain convert hf-import HF_DIR OUT_DIR                       # -> model directory
    moetrain convert hf-export CKPT_DIR OUT_DIR [--layout fused]    # -> config.json + model.safetensors

HF side: `config.json` plus `*.safetensors` (one file, or shards listed in
`model.safetensors.index.json`; F32/F16/BF16, and FP8 block-quantized weights with
`weight_scale_inv`, see `hf_io.py`). Routed experts come in two layouts, both read:

    per_expert (published checkpoints;       Mixtral   block_sparse_moe.gate.weight            [E, H]
      what transformers 5 writes on save)              block_sparse_moe.experts.{j}.w1/w3.weight [F, H], w2 [H, F]
                                             others    mlp.gate.weight, mlp.experts.{j}.{gate,up,down}_proj.weight
    fused (transformers 5 in memory)         all       mlp.gate.weight                          [E, H]
                                                       mlp.experts.gate_up_proj  [E, 2F, H] (gate rows, then up)
                                                       mlp.experts.down_proj     [E, H, F]

moetrain keeps experts as `moe.experts.w_gate / w_up [E, H, F]`, `w_down [E, F, H]`, so conversion
transposes each expert matrix; everything else is renamed only. DeepSeek-V3's multi-token-prediction
layer k sits at `model.layers.{num_hidden_layers + k}` in published checkpoints (its `enorm`, `hnorm`,
`eh_proj`, `shared_head.norm`, a full decoder layer, and copies of the embedding and LM head, which
moetrain shares: import checks that they are copies, export writes them). Import consumes every
tensor or fails naming the leftovers. Tensors become fp32 exactly, so export after import reproduces
the HF tensors bit for bit (in fp32).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
from safetensors.numpy import save_file

from moetrain.checkpoint.hf_io import load_hf_weights, read_safetensors  # noqa: F401  (re-exported)
from moetrain.checkpoint.model_dir import (build_config_from_dict, build_model_from_dict, load_model_dir,
                                           load_model_state, save_model_dir)
from moetrain.fileio import check_output_folder, hf_weight_files, temp_path

LAYOUTS = ("per_expert", "fused")

_MODEL_TYPES = {"llama": "gpt", "mistral": "gpt", "mixtral": "moe_gpt", "deepseek_v3": "deepseek_v3",
                "qwen3_moe": "qwen3_moe"}
_DEFAULT_ROPE_THETA = {"mixtral": 1e6, "llama": 1e4, "mistral": 1e4, "deepseek_v3": 1e4, "qwen3_moe": 1e4}
_DEFAULT_NORM_EPS = {"llama": 1e-6, "mistral": 1e-6, "mixtral": 1e-5, "deepseek_v3": 1e-6, "qwen3_moe": 1e-6}
# HF tensors that carry no weights (old checkpoints saved the RoPE frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# DeepSeek-V3's aux-loss-free balancing: bias step per update (paper: 0.001) and sequence-wise aux loss.
DEEPSEEK_BIAS_UPDATE_RATE = 1e-3
DEEPSEEK_SEQ_AUX_LOSS = 1e-4


def _write_atomic_json(path: str, obj) -> None:
    tmp = temp_path(path)
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)


def _not_the_source(src: str, out_dir: str, what: str) -> None:
    if os.path.realpath(src) == os.path.realpath(out_dir):
        raise ValueError(f"moetrain convert {what}: the output folder {out_dir!r} is the input folder; choose a new one")


def read_hf_config(hf_dir: str) -> Dict[str, Any]:
    """config.json of an HF checkpoint folder; a missing or broken file is a ValueError naming it."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{hf_dir!r} is not a Hugging Face checkpoint: config.json is missing")
    try:
        with open(config_path, encoding="utf-8") as fh:
            hf_config = json.load(fh)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config_path} is not valid JSON ({exc}); re-download or fix it") from None
    if not isinstance(hf_config, dict):
        raise ValueError(f"{config_path} holds a {type(hf_config).__name__}, not a JSON object of config keys")
    return hf_config


# ----------------------------------------------------------------------------------------------
# Configs: config.json -> `model:` section
# ----------------------------------------------------------------------------------------------
def _refuse(hf: Dict[str, Any], key: str, why: str):
    raise ValueError(f"config.json: {key}={json.dumps(hf.get(key))}: {why}; hf-import supports the plain "
                     f"{hf.get('model_type')} architecture only")


def _rope_parameters(hf: Dict[str, Any], model_type: str) -> Tuple[float, Dict[str, Any]]:
    """`(rope_theta, scaling)` read as transformers 5 reads config.json: a legacy `rope_scaling` object
    (transformers 4, published DeepSeek-V3) replaces `rope_parameters` whole; theta is that object's
    `rope_theta`, else the top-level `rope_theta`, else the family's default (both keys may be absent);
    the kind is `rope_type` or the legacy `type`. YaRN's original length: the top-level
    `original_max_position_embeddings`, else the object's, else `max_position_embeddings`."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(key) or {}
    if not isinstance(params, dict):
        _refuse(hf, key, "expected a JSON object of RoPE settings")
    if any(isinstance(value, dict) for value in params.values()):
        _refuse(hf, key, "RoPE settings per layer type are not implemented")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    scaling = dict(params)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if (scaling.get("partial_rotary_factor") or 1.0) != 1.0:
        _refuse(hf, key, "partial RoPE (partial_rotary_factor) is not implemented")
    if kind == "default":
        scaling = {}
    elif kind != "yarn" or model_type != "deepseek_v3":
        _refuse(hf, key, f"RoPE scaling {kind!r} is not implemented (YaRN only, for DeepSeek-V3)")
    elif not isinstance(scaling.get("factor"), (int, float)):
        _refuse(hf, key, "YaRN needs its scaling factor (\"factor\": a number)")
    else:
        scaling["original_max_position_embeddings"] = hf.get(
            "original_max_position_embeddings", scaling.get("original_max_position_embeddings", hf["max_position_embeddings"]))
    return float(theta if theta is not None else _DEFAULT_ROPE_THETA[model_type]), scaling


# Sliding-window attention when config.json leaves the keys out (transformers 5 defaults).
_DEFAULT_WINDOW = {"mistral": 4096}
_DEFAULT_USE_WINDOW = {"qwen3_moe": False}


def _check_common(hf: Dict[str, Any]) -> None:
    model_type = hf.get("model_type")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(hf, "hidden_act", "only SwiGLU MLPs (silu) are implemented")
    window = hf.get("sliding_window", _DEFAULT_WINDOW.get(model_type))
    if (window is not None and hf.get("use_sliding_window", _DEFAULT_USE_WINDOW.get(model_type, True))
            and window < hf["max_position_embeddings"]):
        shown = (f"sliding_window={window}" if "sliding_window" in hf else
                 f"sliding_window is absent, so {model_type}'s default {window} applies")
        raise ValueError(f"config.json: {shown}: sliding-window attention (window {window} < "
                         f"max_position_embeddings {hf['max_position_embeddings']}) is not implemented; a window "
                         f"that covers every position (or null) is plain causal attention")
    biases = [key for key in ("attention_bias", "mlp_bias") if hf.get(key)]
    if biases:
        raise ValueError(f"config.json: {', '.join(f'{k}=true' for k in biases)}: moetrain's "
                         f"{_MODEL_TYPES.get(model_type, model_type)} model has no projection biases, so these weights cannot be imported without changing the model's "
                         f"outputs (a checkpoint trained without them has false here)")
    if (hf.get("partial_rotary_factor") or 1.0) != 1.0:
        _refuse(hf, "partial_rotary_factor", "partial RoPE is not implemented")
    if hf.get("pretraining_tp", 1) not in (1, None):
        _refuse(hf, "pretraining_tp", "set it to 1 (it only changes how HF splits the matmuls)")


def hf_config_to_model_dict(hf: Dict[str, Any]) -> Dict[str, Any]:
    """HF config.json -> complete moetrain `model:` section (validated)."""
    model_type = hf.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"config.json: model_type {model_type!r} is not supported; hf-import reads "
                         f"{sorted(_MODEL_TYPES)}")
    _check_common(hf)
    rope_theta, scaling = _rope_parameters(hf, model_type)
    num_heads = hf["num_attention_heads"]
    model = {
        "name": _MODEL_TYPES[model_type],
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": num_heads,
        "num_kv_heads": hf.get("num_key_value_heads") or num_heads,
        "ffn_hidden_size": hf["intermediate_size"],
        "seq_length": hf["max_position_embeddings"],
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // num_heads,
        "rope_theta": rope_theta,
        "norm_eps": float(hf.get("rms_norm_eps", _DEFAULT_NORM_EPS[model_type])),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "init_std": float(hf.get("initializer_range", 0.02)),
    }
    if model_type == "mixtral":
        model.update(first_k_dense=0, moe_layer_freq=1, moe=_moe_section(
            num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], ffn_hidden_size=hf["intermediate_size"],
            aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001))))
    elif model_type == "qwen3_moe":
        model.update(decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                     mlp_only_layers=list(hf.get("mlp_only_layers") or []),
                     moe=_moe_section(num_experts=hf.get("num_experts", hf.get("num_local_experts")),
                                      top_k=hf["num_experts_per_tok"], ffn_hidden_size=hf["moe_intermediate_size"],
                                      norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                                      aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001))))
    elif model_type == "deepseek_v3":
        model.update(_deepseek_fields(hf, scaling))
    try:
        cfg = build_config_from_dict(model)
    except ValueError as exc:
        raise ValueError(f"config.json describes a model moetrain cannot build: {exc}") from None
    return dataclasses.asdict(cfg)


def _moe_section(**keys) -> Dict[str, Any]:
    """A Mixtral-style `moe:` section (softmax, renormalised top-k, dropless) with `keys` replaced."""
    moe = {"num_shared_experts": 0, "score_func": "softmax", "norm_topk_prob": True, "route_scale": 1.0,
           "num_groups": 1, "topk_groups": 1, "capacity_factor": 0.0}
    moe.update(keys)
    return moe


def _deepseek_fields(hf: Dict[str, Any], scaling: Dict[str, Any]) -> Dict[str, Any]:
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        _refuse(hf, "scoring_func", "DeepSeek-V3 routes with sigmoid scores")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        _refuse(hf, "topk_method", "DeepSeek-V3 uses noaux_tc (group-limited top-k with the correction bias)")
    if hf.get("moe_layer_freq", 1) != 1:
        _refuse(hf, "moe_layer_freq", "every layer after first_k_dense_replace is MoE in DeepSeek-V3")
    num_heads = hf["num_attention_heads"]
    fields = {
        "num_kv_heads": num_heads, "head_dim": hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
        "q_lora_rank": hf.get("q_lora_rank") or 0, "kv_lora_rank": hf["kv_lora_rank"],
        "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": hf["qk_rope_head_dim"],
        "v_head_dim": hf["v_head_dim"], "rope_interleave": bool(hf.get("rope_interleave", True)),
        "first_k_dense": hf.get("first_k_dense_replace", 0), "moe_layer_freq": 1,
        "mtp_depth": hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0,
        "moe": _moe_section(
            num_experts=hf.get("n_routed_experts", hf.get("num_local_experts")), top_k=hf["num_experts_per_tok"],
            ffn_hidden_size=hf["moe_intermediate_size"], num_shared_experts=hf.get("n_shared_experts") or 0,
            score_func="sigmoid", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            route_scale=float(hf.get("routed_scaling_factor", 1.0)), num_groups=hf.get("n_group") or 1,
            topk_groups=hf.get("topk_group") or 1, group_score_topk=2, aux_loss_coeff=0.0,
            seq_aux_loss_coeff=float(hf.get("aux_loss_alpha", DEEPSEEK_SEQ_AUX_LOSS)),
            bias_update_rate=DEEPSEEK_BIAS_UPDATE_RATE)}
    if scaling:
        fields.update(yarn_factor=float(scaling["factor"]),
                      yarn_original_max_positions=int(scaling["original_max_position_embeddings"]),
                      yarn_beta_fast=float(scaling.get("beta_fast") or 32), yarn_beta_slow=float(scaling.get("beta_slow") or 1),
                      yarn_mscale=float(scaling.get("mscale") or 0.0),
                      yarn_mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0))
        if scaling.get("attention_factor") is not None or scaling.get("truncate", True) is not True:
            _refuse(hf, "rope_parameters", "YaRN with an explicit attention_factor or truncate: false is not implemented")
    return fields


# ----------------------------------------------------------------------------------------------
# Configs: `model:` section -> config.json
# ----------------------------------------------------------------------------------------------
def model_dict_to_hf_config(model: Dict[str, Any]) -> Dict[str, Any]:
    """moetrain `model:` section -> HF config.json of its family."""
    cfg = build_config_from_dict(model)
    exporters = {"gpt": _llama_config, "moe_gpt": _mixtral_config, "qwen3_moe": _qwen3_config,
                 "deepseek_v3": _deepseek_config}
    if cfg.name not in exporters:
        raise ValueError(f"model.name {cfg.name!r} has no Hugging Face format; hf-export handles "
                         f"{sorted(exporters)}")
    hf = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_hidden_size, "max_position_embeddings": cfg.seq_length,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std, "hidden_act": "silu", "attention_dropout": 0.0, "torch_dtype": "float32",
        "use_cache": True,
    }
    hf.update(exporters[cfg.name](cfg))
    return hf


def _refuse_export(family: str, key: str, value, want: str):
    raise ValueError(f"model.{key}={value!r} cannot be expressed in the {family} format (needs {want})")


def _check_moe_export(cfg, family: str, **want) -> None:
    """Refuse MoE settings `family` cannot express; `want`: moe key -> (required value, why)."""
    for key, (value, why) in want.items():
        if getattr(cfg.moe, key) != value:
            _refuse_export(family, f"moe.{key}", getattr(cfg.moe, key), why)


def _llama_config(cfg) -> Dict[str, Any]:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_bias": False, "mlp_bias": False}


def _mixtral_config(cfg) -> Dict[str, Any]:
    if cfg.first_k_dense != 0:
        _refuse_export("Mixtral", "first_k_dense", cfg.first_k_dense, "0: every layer is MoE")
    if cfg.moe_layer_freq != 1:
        _refuse_export("Mixtral", "moe_layer_freq", cfg.moe_layer_freq, "1: every layer is MoE")
    _check_moe_export(cfg, "Mixtral", num_shared_experts=(0, "0"), score_func=("softmax", "'softmax'"),
                      norm_topk_prob=(True, "true: Mixtral renormalises the top-k weights"), route_scale=(1.0, "1.0"),
                      num_groups=(1, "1: no group-limited routing"))
    moe = cfg.moe
    return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "intermediate_size": moe.ffn_hidden_size,
            "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.aux_loss_coeff, "output_router_logits": False, "router_jitter_noise": 0.0,
            "sliding_window": None}


def _qwen3_config(cfg) -> Dict[str, Any]:
    _check_moe_export(cfg, "Qwen3-MoE", num_shared_experts=(0, "0"), score_func=("softmax", "'softmax'"),
                      route_scale=(1.0, "1.0"), num_groups=(1, "1: no group-limited routing"))
    moe = cfg.moe
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "moe_intermediate_size": moe.ffn_hidden_size,
            "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.norm_topk_prob,
            "decoder_sparse_step": cfg.decoder_sparse_step, "mlp_only_layers": list(cfg.mlp_only_layers),
            "router_aux_loss_coef": moe.aux_loss_coeff, "output_router_logits": False, "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None}


def _deepseek_config(cfg) -> Dict[str, Any]:
    if cfg.moe_layer_freq != 1:
        _refuse_export("DeepSeek-V3", "moe_layer_freq", cfg.moe_layer_freq, "1: every layer after first_k_dense is MoE")
    moe = cfg.moe
    _check_moe_export(cfg, "DeepSeek-V3", score_func=("sigmoid", "'sigmoid'"),
                      shared_ffn_hidden_size=(0, "0: n_shared_experts x moe_intermediate_size"))
    if moe.num_shared_experts < 1:
        _refuse_export("DeepSeek-V3", "moe.num_shared_experts", moe.num_shared_experts, ">= 1")
    if moe.num_groups > 1 and moe.group_score_experts != 2:
        _refuse_export("DeepSeek-V3", "moe.group_score_topk", moe.group_score_topk,
                       "2: HF scores a group by its top-2 experts")
    hf = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "num_key_value_heads": cfg.num_heads,
          "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
          "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
          "v_head_dim": cfg.v_head_dim, "head_dim": cfg.qk_rope_head_dim, "rope_interleave": cfg.rope_interleave,
          "first_k_dense_replace": cfg.first_k_dense, "num_nextn_predict_layers": cfg.mtp_depth,
          "moe_intermediate_size": moe.ffn_hidden_size, "n_routed_experts": moe.num_experts,
          "num_experts_per_tok": moe.top_k, "n_shared_experts": moe.num_shared_experts,
          "norm_topk_prob": moe.norm_topk_prob, "routed_scaling_factor": moe.route_scale, "n_group": moe.num_groups,
          "topk_group": moe.topk_groups, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
          "aux_loss_alpha": moe.seq_aux_loss_coeff, "attention_bias": False}
    if cfg.yarn is not None:
        hf["rope_scaling"] = {"type": "yarn", "rope_type": "yarn", "factor": cfg.yarn_factor,
                              "original_max_position_embeddings": cfg.yarn_original_max_positions,
                              "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow,
                              "mscale": cfg.yarn_mscale, "mscale_all_dim": cfg.yarn_mscale_all_dim}
    return hf


# ----------------------------------------------------------------------------------------------
# Weights: one table of (moetrain names <-> HF names, conversion both ways) per model
# ----------------------------------------------------------------------------------------------
@dataclass
class TensorMap:
    """`ours` tensors <-> `theirs` tensors; `to_ours(*theirs) -> tuple(ours)`, `to_theirs(*ours) -> tuple(theirs)`."""
    ours: Tuple[str, ...]
    theirs: Tuple[str, ...]
    to_ours: Callable = lambda *arrays: arrays
    to_theirs: Callable = lambda *arrays: arrays


def _rename(ours: str, theirs: str) -> TensorMap:
    return TensorMap((ours,), (theirs,))


def _experts_per_expert(ours: str, theirs: str, num_experts: int, names: Tuple[str, str, str]) -> TensorMap:
    """`w_gate, w_up [E, H, F]`, `w_down [E, F, H]` <-> `{theirs}{j}.{gate,up,down name}.weight` `[out, in]`."""
    hf_names = tuple(f"{theirs}{j}.{name}.weight" for name in names for j in range(num_experts))

    def to_ours(*arrays):
        return tuple(np.stack([a.T for a in arrays[k * num_experts:(k + 1) * num_experts]]) for k in range(3))

    def to_theirs(*stacked):
        return tuple(w[j].T for w in stacked for j in range(num_experts))

    return TensorMap(tuple(f"{ours}{n}" for n in ("w_gate", "w_up", "w_down")), hf_names, to_ours, to_theirs)


def _experts_fused(ours: str, theirs: str, ffn: int) -> TensorMap:
    """`w_gate, w_up, w_down` <-> `gate_up_proj [E, 2F, H]` (gate rows first), `down_proj [E, H, F]`."""
    def to_ours(gate_up, down):
        return gate_up[:, :ffn].transpose(0, 2, 1), gate_up[:, ffn:].transpose(0, 2, 1), down.transpose(0, 2, 1)

    def to_theirs(w_gate, w_up, w_down):
        return np.concatenate([w_gate.transpose(0, 2, 1), w_up.transpose(0, 2, 1)], axis=1), w_down.transpose(0, 2, 1)

    return TensorMap(tuple(f"{ours}{n}" for n in ("w_gate", "w_up", "w_down")),
                     (f"{theirs}gate_up_proj", f"{theirs}down_proj"), to_ours, to_theirs)


def _unbiased_routing(ours: str, num_experts: int, family: str) -> TensorMap:
    """`expert_bias` of a family whose routing has none: zeros on import, must be zero on export."""
    def to_theirs(bias):
        if np.any(bias != 0):
            raise ValueError(f"{ours} is non-zero (aux-loss-free balancing): {family} routing has no expert "
                             f"bias, so the exported model would choose different experts")
        return ()

    return TensorMap((ours,), (), lambda: (np.zeros(num_experts, np.float32),), to_theirs)


_LLAMA_ATTENTION = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
_DEEPSEEK_ATTENTION = {"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj", "wq": "q_proj",
                       "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
_SWIGLU = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def _block_maps(model: Dict[str, Any], moe: bool, ours: str, theirs: str, fused: bool) -> List[TensorMap]:
    """One decoder layer: norms, attention, dense MLP or MoE (router, experts, shared experts, bias)."""
    name = model["name"]
    maps = [_rename(ours + "attention_norm.weight", theirs + "input_layernorm.weight"),
            _rename(ours + "ffn_norm.weight", theirs + "post_attention_layernorm.weight")]
    if name == "deepseek_v3":
        used = ("wq_a", "q_norm", "wq_b") if model["q_lora_rank"] else ("wq",)
        attention = {k: _DEEPSEEK_ATTENTION[k] for k in used + ("wkv_a", "kv_norm", "wkv_b", "wo")}
    else:
        attention = dict(_LLAMA_ATTENTION, **({"q_norm": "q_norm", "k_norm": "k_norm"} if name == "qwen3_moe" else {}))
    maps += [_rename(f"{ours}attention.{k}.weight", f"{theirs}self_attn.{v}.weight") for k, v in attention.items()]
    if not moe:
        return maps + [_rename(f"{ours}mlp.{k}.weight", f"{theirs}mlp.{v}.weight") for k, v in _SWIGLU.items()]
    experts = model["moe"]["num_experts"]
    mixtral_names = name == "moe_gpt" and not fused
    hf_moe = theirs + ("block_sparse_moe." if mixtral_names else "mlp.")
    maps.append(_rename(ours + "moe.router.weight", hf_moe + "gate.weight"))
    if fused:
        maps.append(_experts_fused(ours + "moe.experts.", hf_moe + "experts.", model["moe"]["ffn_hidden_size"]))
    else:
        names = ("w1", "w3", "w2") if mixtral_names else ("gate_proj", "up_proj", "down_proj")
        maps.append(_experts_per_expert(ours + "moe.experts.", hf_moe + "experts.", experts, names))
    if model["moe"]["num_shared_experts"]:
        maps += [_rename(f"{ours}moe.shared_experts.{k}.weight", f"{hf_moe}shared_experts.{v}.weight")
                 for k, v in _SWIGLU.items()]
    if name == "deepseek_v3":
        maps.append(_rename(ours + "moe.expert_bias", hf_moe + "gate.e_score_correction_bias"))
    else:
        maps.append(_unbiased_routing(ours + "moe.expert_bias", experts, {"moe_gpt": "Mixtral"}.get(name, "Qwen3-MoE")))
    return maps


def tensor_maps(model: Dict[str, Any], fused_layers=lambda hf_prefix: False) -> Tuple[List[TensorMap], Dict[str, str]]:
    """`(maps, copies)` for the `model:` section: every moetrain tensor's HF counterpart; `copies`:
    HF tensors that duplicate a moetrain tensor (DeepSeek MTP embedding/head), HF name -> ours.
    `fused_layers(hf_layer_prefix)` says which layers use the fused expert layout."""
    cfg = build_config_from_dict(model)
    maps = [_rename("embed.weight", "model.embed_tokens.weight"), _rename("final_norm.weight", "model.norm.weight")]
    head = "embed.weight" if model["tie_embeddings"] else "lm_head.weight"
    if not model["tie_embeddings"]:
        maps.append(_rename("lm_head.weight", "lm_head.weight"))
    is_moe = getattr(cfg, "is_moe_layer", lambda i: False)
    for i in range(model["num_layers"]):
        theirs = f"model.layers.{i}."
        maps += _block_maps(model, is_moe(i), f"layers.{i}.", theirs, fused_layers(theirs))
    copies = {}
    for k in range(model.get("mtp_depth", 0)):
        ours, theirs = f"mtp.{k}.", f"model.layers.{model['num_layers'] + k}."
        maps += [_rename(ours + "enorm.weight", theirs + "enorm.weight"),
                 _rename(ours + "hnorm.weight", theirs + "hnorm.weight"),
                 _rename(ours + "eh_proj.weight", theirs + "eh_proj.weight"),
                 _rename(ours + "final_norm.weight", theirs + "shared_head.norm.weight")]
        maps += _block_maps(model, True, ours + "block.", theirs, fused_layers(theirs))
        copies.update({theirs + "embed_tokens.weight": "embed.weight", theirs + "shared_head.head.weight": head})
    return maps, copies


def hf_to_state(hf: Dict[str, np.ndarray], model: Dict[str, Any]) -> Dict[str, np.ndarray]:
    """HF tensors -> moetrain state for the `model:` section `model` (from hf_config_to_model_dict)."""
    maps, copies = tensor_maps(model, lambda prefix: prefix + "mlp.experts.gate_up_proj" in hf)
    if model["tie_embeddings"]:   # some writers keep the tied head's copy; it must equal the embedding
        copies["lm_head.weight"] = "embed.weight"
    used, state = set(), {}
    for m in maps:
        absent = [n for n in m.theirs if n not in hf]
        if absent:
            depth = f", MTP depth {model['mtp_depth']}" if model.get("mtp_depth") else ""
            raise ValueError(f"the HF checkpoint has no tensor {absent[0]!r} (needed for a {model['name']} model "
                             f"with {model['num_layers']} layers{depth})")
        used.update(m.theirs)
        state.update(zip(m.ours, m.to_ours(*(hf[n] for n in m.theirs))))
    for name, ours in copies.items():
        if name in hf:   # published checkpoints carry these copies; they must equal the shared tensor
            if hf[name].shape != state[ours].shape or not np.array_equal(hf[name], state[ours]):
                raise ValueError(f"the HF checkpoint's {name!r} differs from the main model's {ours} counterpart; "
                                 f"moetrain shares it ({'tie_word_embeddings' if name == 'lm_head.weight' else 'the MTP layers use the main embedding and LM head'})")
            used.add(name)
    unused = sorted(n for n in set(hf) - used if not n.endswith(_IGNORED_SUFFIXES))
    if unused:
        raise ValueError(f"the HF checkpoint has tensors this {model['name']} model has no place for: "
                         f"{unused[:10]}{' ...' if len(unused) > 10 else ''} (another architecture, or a config.json "
                         f"that does not describe these weights?)")
    return {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in state.items()}


def state_to_hf(state: Dict[str, np.ndarray], model: Dict[str, Any], layout: str = "per_expert"):
    """moetrain state -> HF tensors (the inverse of `hf_to_state`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    maps, copies = tensor_maps(model, lambda prefix: layout == "fused")
    hf = {}
    for m in maps:
        hf.update(zip(m.theirs, m.to_theirs(*(state[n] for n in m.ours))))
    hf.update({name: state[ours] for name, ours in copies.items()})
    return {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in hf.items()}


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------
def mtp_layers_present(hf: Dict[str, np.ndarray], model: Dict[str, Any]) -> int:
    """How many of the MTP layers `model` describes the checkpoint holds (`model.layers.{L + k}.eh_proj`)."""
    depth = 0
    while depth < model.get("mtp_depth", 0) and f"model.layers.{model['num_layers'] + depth}.eh_proj.weight" in hf:
        depth += 1
    return depth


def _fresh_mtp_layers(model: Dict[str, Any], first: int) -> Dict[str, np.ndarray]:
    """Freshly initialised tensors of MTP layers `first..mtp_depth-1` (the model's own init)."""
    fresh = build_model_from_dict(model)
    wanted = tuple(f"mtp.{k}." for k in range(first, model["mtp_depth"]))
    return {p.name: p.asnumpy() for p in fresh.get_parameters() if p.name.startswith(wanted)}


def hf_import(hf_dir: str, out_dir: str, check: bool = True, init_missing_mtp: bool = False,
              log: Callable[[str], None] = print, overwrite: bool = False) -> Dict[str, Any]:
    """HF checkpoint directory -> moetrain model directory; returns the `model:` section.

    DeepSeek-V3's MTP depth is what the checkpoint holds: transformers' model has no MTP layer, so
    `save_pretrained` writes none while its config.json keeps `num_nextn_predict_layers`. Missing
    MTP layers are left out (depth = the layers present), or with `init_missing_mtp` initialised
    fresh for training; either way one line says so.
    With `check`, the model is built and the weights loaded strictly (names and shapes).
    `out_dir` must be new or empty (with `overwrite`, a folder of files to replace), never a training
    checkpoint or run folder (`moetrain.fileio.check_output_folder`)."""
    _not_the_source(hf_dir, out_dir, "hf-import")
    check_output_folder(out_dir, overwrite, "moetrain convert hf-import")
    hf_config = read_hf_config(hf_dir)
    config_path = os.path.join(hf_dir, "config.json")
    try:
        model = hf_config_to_model_dict(hf_config)
    except KeyError as exc:
        raise ValueError(f"{config_path}: the key {exc.args[0]!r} is missing "
                         f"(model_type {hf_config.get('model_type')!r} needs it); the file is incomplete or not a "
                         f"transformers config") from None
    except ValueError as exc:     # name the file read, not just "config.json"
        message = str(exc)
        raise ValueError(config_path + message[len("config.json"):] if message.startswith("config.json")
                         else message) from None
    hf = load_hf_weights(hf_dir, hf_config.get("quantization_config"))
    promised, present = model.get("mtp_depth", 0), mtp_layers_present(hf, model)
    if present < promised:
        model["mtp_depth"] = present
    state = hf_to_state(hf, model)
    if present < promised:
        missing = f"{promised - present} of its {promised}"
        if init_missing_mtp:
            model["mtp_depth"] = promised
            state.update(_fresh_mtp_layers(model, present))
            log(f"moetrain convert hf-import: config.json has num_nextn_predict_layers={promised} but the checkpoint "
                f"holds {present} MTP layer(s); {missing} MTP layer(s) initialised fresh (--init-missing-mtp)")
        else:
            log(f"moetrain convert hf-import: config.json has num_nextn_predict_layers={promised} but the checkpoint "
                f"holds {present} MTP layer(s) (transformers' save_pretrained writes none); imported with "
                f"mtp_depth {present} (--init-missing-mtp initialises {missing} fresh instead)")
    if check:
        load_model_state(build_model_from_dict(model, deferred=True), state, strict=True)
    save_model_dir(out_dir, {"model": model}, state)
    return model


def hf_export(model_dir: str, out_dir: str, layout: str = "per_expert", overwrite: bool = False) -> Dict[str, Any]:
    """moetrain model directory (or training checkpoint) -> HF config.json + model.safetensors.

    `out_dir` must be new or empty; with `overwrite` its config.json is replaced and every HF weight
    file already there (other *.safetensors, model.safetensors.index.json) removed, so a reader that
    follows an old shard index never loads the old weights. Never a training checkpoint or run folder."""
    _not_the_source(model_dir, out_dir, "hf-export")
    check_output_folder(out_dir, overwrite, "moetrain convert hf-export")
    config_dict, state = load_model_dir(model_dir)
    model = dataclasses.asdict(build_config_from_dict(config_dict["model"]))
    hf_config = model_dict_to_hf_config(model)
    tensors = state_to_hf(state, model, layout)
    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, "model.safetensors")
    stale = [p for p in hf_weight_files(out_dir) if os.path.abspath(p) != os.path.abspath(weights)]
    tmp = temp_path(weights)
    save_file(tensors, tmp, metadata={"format": "pt"})   # transformers requires "pt"
    for path in stale:     # an earlier export's shards and index: readers would follow them
        os.remove(path)
    os.replace(tmp, weights)
    _write_atomic_json(os.path.join(out_dir, "config.json"), hf_config)
    if stale:
        print(f"moetrain convert hf-export: --overwrite: removed the earlier weight files of {out_dir}: "
              f"{', '.join(os.path.basename(p) for p in stale)}")
    return hf_config


def _run(fn, argv) -> int:
    try:
        fn(argv)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"moetrain convert: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, MemoryError) as exc:
        print(f"moetrain convert: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


def main_import(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moetrain convert hf-import",
                                 description="Hugging Face Llama/Mistral/Mixtral/DeepSeek-V3/Qwen3-MoE checkpoint -> moetrain model directory")
    ap.add_argument("hf_dir", help="folder with config.json and *.safetensors")
    ap.add_argument("out_dir", help="model directory to write (config.yaml + model.safetensors)")
    ap.add_argument("--init-missing-mtp", action="store_true",
                    help="DeepSeek-V3: MTP layers config.json promises but the checkpoint lacks (transformers' "
                         "save_pretrained writes none) are initialised fresh instead of left out")
    ap.add_argument("--overwrite", action="store_true",
                    help="write into an OUT_DIR that already holds files, replacing config.yaml and model.safetensors "
                         "(never a training checkpoint or run folder)")

    def go(args):
        args = ap.parse_args(args)
        model = hf_import(args.hf_dir, args.out_dir, init_missing_mtp=args.init_missing_mtp, overwrite=args.overwrite)
        print(f"wrote {args.out_dir}: model {model['name']}, {model['num_layers']} layers")

    return _run(go, argv)


def main_export(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moetrain convert hf-export",
                                 description="moetrain model directory -> Hugging Face Llama/Mixtral/DeepSeek-V3/Qwen3-MoE checkpoint")
    ap.add_argument("ckpt_dir", help="model directory or training checkpoint folder")
    ap.add_argument("out_dir", help="folder to write config.json and model.safetensors to")
    ap.add_argument("--layout", choices=LAYOUTS, default="per_expert",
                    help="routed-expert tensors: per_expert (published checkpoints, the default) or fused (transformers 5 in memory)")
    ap.add_argument("--overwrite", action="store_true",
                    help="write into an out_dir that already holds files: config.json and model.safetensors are "
                         "replaced and other HF weight files there (shards, index) removed; never a training "
                         "checkpoint or run folder")

    def go(args):
        args = ap.parse_args(args)
        hf_config = hf_export(args.ckpt_dir, args.out_dir, args.layout, overwrite=args.overwrite)
        print(f"wrote {args.out_dir}: {hf_config['architectures'][0]} ({args.layout} layout)")

    return _run(go, argv)


if __name__ == "__main__":   # python -m moetrain.checkpoint.hf {hf-import,hf-export} ...
    commands = {"hf-import": main_import, "hf-export": main_export}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: python -m moetrain.checkpoint.hf {{{','.join(commands)}}} ...")
    sys.exit(commands[sys.argv[1]](sys.argv[2:]))
