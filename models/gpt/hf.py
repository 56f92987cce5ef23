"""Hugging Face Llama / Mistral <-> `gpt`, and the Llama-style pieces (config keys, RoPE settings,
decoder-layer tensor names) that the other transformer families' formats build on.

Tensor names: `embed.weight` <-> `model.embed_tokens.weight`, `final_norm` <-> `model.norm`,
`lm_head` <-> `lm_head`, and per layer `attention_norm` / `ffn_norm` <-> `input_layernorm` /
`post_attention_layernorm`, `attention.{wq,wk,wv,wo}` <-> `self_attn.{q,k,v,o}_proj`,
`mlp.{w_gate,w_up,w_down}` <-> `mlp.{gate,up,down}_proj`; all renamed only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from moetrain.family import HFFormat, TensorMap, rename


@dataclass(frozen=True)
class Defaults:
    """transformers' defaults of one `model_type` for keys config.json may leave out."""
    rope_theta: float
    norm_eps: float
    sliding_window: Optional[int] = None      # the window when `sliding_window` is absent
    use_sliding_window: bool = True           # `use_sliding_window` when absent


DEFAULTS = {"llama": Defaults(1e4, 1e-6), "mistral": Defaults(1e4, 1e-6, sliding_window=4096)}

ATTENTION = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
SWIGLU = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def refuse(hf: Dict[str, Any], key: str, why: str):
    raise ValueError(f"config.json: {key}={json.dumps(hf.get(key))}: {why}; hf-import supports the plain "
                     f"{hf.get('model_type')} architecture only")


def rope_parameters(hf: Dict[str, Any], defaults: Defaults, yarn: bool = False) -> Tuple[float, Dict[str, Any]]:
    """`(rope_theta, scaling)` read as transformers 5 reads config.json: a legacy `rope_scaling` object
    (transformers 4, published DeepSeek-V3) replaces `rope_parameters` whole; theta is that object's
    `rope_theta`, else the top-level `rope_theta`, else the family's default (both keys may be absent);
    the kind is `rope_type` or the legacy `type`; `yarn`: the family reads YaRN scaling. YaRN's
    original length: the top-level `original_max_position_embeddings`, else the object's, else
    `max_position_embeddings`."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(key) or {}
    if not isinstance(params, dict):
        refuse(hf, key, "expected a JSON object of RoPE settings")
    if any(isinstance(value, dict) for value in params.values()):
        refuse(hf, key, "RoPE settings per layer type are not implemented")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    scaling = dict(params)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if (scaling.get("partial_rotary_factor") or 1.0) != 1.0:
        refuse(hf, key, "partial RoPE (partial_rotary_factor) is not implemented")
    if kind == "default":
        scaling = {}
    elif kind != "yarn" or not yarn:
        refuse(hf, key, f"RoPE scaling {kind!r} is not implemented (YaRN only, for DeepSeek-V3)")
    elif not isinstance(scaling.get("factor"), (int, float)):
        refuse(hf, key, "YaRN needs its scaling factor (\"factor\": a number)")
    else:
        scaling["original_max_position_embeddings"] = hf.get(
            "original_max_position_embeddings", scaling.get("original_max_position_embeddings", hf["max_position_embeddings"]))
    return float(theta if theta is not None else defaults.rope_theta), scaling


def check_common(hf: Dict[str, Any], defaults: Defaults, family: str) -> None:
    """Refuse what no Llama-style family implements: other activations, sliding windows, biases, partial RoPE."""
    model_type = hf.get("model_type")
    if hf.get("hidden_act", "silu") != "silu":
        refuse(hf, "hidden_act", "only SwiGLU MLPs (silu) are implemented")
    window = hf.get("sliding_window", defaults.sliding_window)
    if (window is not None and hf.get("use_sliding_window", defaults.use_sliding_window)
            and window < hf["max_position_embeddings"]):
        shown = (f"sliding_window={window}" if "sliding_window" in hf else
                 f"sliding_window is absent, so {model_type}'s default {window} applies")
        raise ValueError(f"config.json: {shown}: sliding-window attention (window {window} < "
                         f"max_position_embeddings {hf['max_position_embeddings']}) is not implemented; a window "
                         f"that covers every position (or null) is plain causal attention")
    biases = [key for key in ("attention_bias", "mlp_bias") if hf.get(key)]
    if biases:
        raise ValueError(f"config.json: {', '.join(f'{k}=true' for k in biases)}: moetrain's "
                         f"{family} model has no projection biases, so these weights cannot be imported without changing the model's "
                         f"outputs (a checkpoint trained without them has false here)")
    if (hf.get("partial_rotary_factor") or 1.0) != 1.0:
        refuse(hf, "partial_rotary_factor", "partial RoPE is not implemented")
    if hf.get("pretraining_tp", 1) not in (1, None):
        refuse(hf, "pretraining_tp", "set it to 1 (it only changes how HF splits the matmuls)")


def llama_model_dict(hf: Dict[str, Any], family: str, defaults: Defaults,
                     yarn: bool = False) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """`(model, rope scaling)`: the GPT keys of the `model:` section of family `family` from config.json."""
    check_common(hf, defaults, family)
    rope_theta, scaling = rope_parameters(hf, defaults, yarn)
    num_heads = hf["num_attention_heads"]
    model = {
        "name": family,
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": num_heads,
        "num_kv_heads": hf.get("num_key_value_heads") or num_heads,
        "ffn_hidden_size": hf["intermediate_size"],
        "seq_length": hf["max_position_embeddings"],
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // num_heads,
        "rope_theta": rope_theta,
        "norm_eps": float(hf.get("rms_norm_eps", defaults.norm_eps)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "init_std": float(hf.get("initializer_range", 0.02)),
    }
    return model, scaling


def llama_config(cfg, **family_keys) -> Dict[str, Any]:
    """config.json of a GPT-style model config: the Llama keys, then `family_keys` over them."""
    hf = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_hidden_size, "max_position_embeddings": cfg.seq_length,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std, "hidden_act": "silu", "attention_dropout": 0.0, "torch_dtype": "float32",
        "use_cache": True,
    }
    hf.update(family_keys)
    return hf


def layer_maps(ours: str, theirs: str, attention: Dict[str, str]) -> List[TensorMap]:
    """A decoder layer's norms and attention projections (`attention`: our name -> HF's)."""
    maps = [rename(ours + "attention_norm.weight", theirs + "input_layernorm.weight"),
            rename(ours + "ffn_norm.weight", theirs + "post_attention_layernorm.weight")]
    return maps + [rename(f"{ours}attention.{k}.weight", f"{theirs}self_attn.{v}.weight") for k, v in attention.items()]


def dense_mlp_maps(ours: str, theirs: str) -> List[TensorMap]:
    return [rename(f"{ours}mlp.{k}.weight", f"{theirs}mlp.{v}.weight") for k, v in SWIGLU.items()]


BlockMaps = Callable[[Dict[str, Any], bool, str, str, bool], List[TensorMap]]


def stack_maps(model: Dict[str, Any], cfg, fused_layers, block_maps: BlockMaps) -> List[TensorMap]:
    """Embedding, final norm, LM head and every decoder layer (`block_maps(model, is_moe, ours, theirs,
    fused)` gives one layer's maps)."""
    maps = [rename("embed.weight", "model.embed_tokens.weight"), rename("final_norm.weight", "model.norm.weight")]
    if not model["tie_embeddings"]:
        maps.append(rename("lm_head.weight", "lm_head.weight"))
    is_moe = getattr(cfg, "is_moe_layer", lambda i: False)
    for i in range(model["num_layers"]):
        theirs = f"model.layers.{i}."
        maps += block_maps(model, is_moe(i), f"layers.{i}.", theirs, fused_layers(theirs))
    return maps


def tied_head_copy(model: Dict[str, Any]) -> Dict[str, str]:
    """Some writers keep the tied head's copy; import accepts it when it equals the embedding."""
    return {"lm_head.weight": "embed.weight"} if model["tie_embeddings"] else {}


def copy_reason(name: str) -> str:
    return 'tie_word_embeddings' if name == 'lm_head.weight' else 'the MTP layers use the main embedding and LM head'


def _block(model, moe, ours, theirs, fused):
    return layer_maps(ours, theirs, ATTENTION) + dense_mlp_maps(ours, theirs)


FORMAT = HFFormat(
    model_types=tuple(DEFAULTS),
    to_model=lambda hf: llama_model_dict(hf, "gpt", DEFAULTS[hf["model_type"]])[0],
    to_hf=lambda cfg: llama_config(cfg, model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=False,
                                   mlp_bias=False),
    tensor_maps=lambda model, cfg, fused_layers: (stack_maps(model, cfg, fused_layers, _block), {}),
    import_copies=tied_head_copy, copy_reason=copy_reason)
