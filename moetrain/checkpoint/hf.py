"""Hugging Face interchange: Mixtral <-> `moe_gpt`, Llama <-> `gpt`.

    moetrain convert hf-import HF_DIR OUT_DIR                       # -> model directory
    moetrain convert hf-export CKPT_DIR OUT_DIR [--layout fused]    # -> config.json + model.safetensors

HF side: `config.json` plus `*.safetensors` (one file, or shards listed in
`model.safetensors.index.json`; F32/F16/BF16). Mixtral experts come in two layouts, both read:

    per_expert (transformers < 5)   model.layers.{i}.block_sparse_moe.gate.weight        [E, H]
                                    model.layers.{i}.block_sparse_moe.experts.{j}.w1/w3.weight [F, H]
                                    model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight    [H, F]
    fused (transformers >= 5)       model.layers.{i}.mlp.gate.weight                     [E, H]
                                    model.layers.{i}.mlp.experts.gate_up_proj            [E, 2F, H] (w1 rows, then w3)
                                    model.layers.{i}.mlp.experts.down_proj               [E, H, F]

moetrain keeps experts as `moe.experts.w_gate / w_up [E, H, F]`, `w_down [E, F, H]` (batched-matmul
friendly), so conversion transposes each expert matrix; everything else is renamed only. The
router (`moe.router.weight`) sees the normed hidden state, softmax -> top-k -> renormalise, as in
Mixtral. Tensors are converted to fp32 exactly (bf16/fp16 -> fp32 is lossless), so export after
import reproduces the HF tensors bit for bit (in fp32).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import struct
import sys
from typing import Any, Dict

import numpy as np

from moetrain.checkpoint.model_dir import build_config_from_dict, load_model_dir, save_model_dir

LAYOUTS = ("per_expert", "fused")

# moetrain name -> HF name, inside `layers.{i}.` / `model.layers.{i}.`.
_BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_DENSE_MLP_NAMES = {
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}
# HF tensors that carry no weights (old checkpoints saved the RoPE frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_MODEL_TYPES = {"mixtral": "moe_gpt", "llama": "gpt", "mistral": "gpt"}
_DEFAULT_ROPE_THETA = {"mixtral": 1e6, "llama": 1e4, "mistral": 1e4}


# ----------------------------------------------------------------------------------------------
# safetensors I/O (own reader: numpy has no bfloat16, which most HF checkpoints use)
# ----------------------------------------------------------------------------------------------
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}


def read_safetensors(path: str) -> Dict[str, np.ndarray]:
    """All tensors of a .safetensors file as fp32 arrays."""
    with open(path, "rb") as fh:
        header_len = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = data[start:end]
        if info["dtype"] == "BF16":   # the top half of an fp32: widen exactly
            array = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        elif info["dtype"] in _SAFETENSORS_DTYPES:
            array = raw.view(np.dtype(_SAFETENSORS_DTYPES[info["dtype"]]).newbyteorder("<"))
        else:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}; only F32, F16, BF16 and F64 "
                             f"weights can be imported (dequantize the checkpoint first)")
        tensors[name] = array.astype(np.float32).reshape(info["shape"])
    return tensors


def load_hf_weights(hf_dir: str) -> Dict[str, np.ndarray]:
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
        paths = [os.path.join(hf_dir, f) for f in files]
    else:
        paths = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not paths:
        raise FileNotFoundError(f"{hf_dir!r} has no *.safetensors weights (PyTorch .bin checkpoints are not "
                                f"supported: re-save them with safetensors)")
    weights = {}
    for path in paths:
        weights.update(read_safetensors(path))
    return weights


def _write_atomic_json(path: str, obj) -> None:
    with open(path + ".tmp", "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------
def hf_config_to_model_dict(hf: Dict[str, Any]) -> Dict[str, Any]:
    """HF Mixtral/Llama config.json -> complete moetrain `model:` section (validated)."""
    model_type = hf.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"config.json: model_type {model_type!r} is not supported; hf-import reads "
                         f"{sorted(_MODEL_TYPES)}")
    _check_supported(hf, model_type)
    rope_theta = hf.get("rope_theta")
    if isinstance(hf.get("rope_parameters"), dict) and "rope_theta" in hf["rope_parameters"]:
        rope_theta = hf["rope_parameters"]["rope_theta"]     # transformers >= 5
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
        "rope_theta": float(rope_theta if rope_theta is not None else _DEFAULT_ROPE_THETA[model_type]),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6 if model_type == "llama" else 1e-5)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "init_std": float(hf.get("initializer_range", 0.02)),
    }
    if model_type == "mixtral":
        model.update(first_k_dense=0, moe_layer_freq=1, moe={
            "num_experts": hf["num_local_experts"],
            "top_k": hf["num_experts_per_tok"],
            "ffn_hidden_size": hf["intermediate_size"],
            "num_shared_experts": 0,
            "score_func": "softmax",
            "norm_topk_prob": True,
            "route_scale": 1.0,
            "num_groups": 1,
            "topk_groups": 1,
            "aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.001)),
            "capacity_factor": 0.0,   # dropless, as Mixtral
        })
    try:
        cfg = build_config_from_dict(model)
    except ValueError as exc:
        raise ValueError(f"config.json describes a model moetrain cannot build: {exc}") from None
    return dataclasses.asdict(cfg)


def _check_supported(hf: Dict[str, Any], model_type: str) -> None:
    def refuse(key, why):
        raise ValueError(f"config.json: {key}={hf.get(key)!r}: {why}; hf-import supports only the plain "
                         f"Llama/Mixtral architecture")

    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "only SwiGLU MLPs (silu) are implemented")
    window = hf.get("sliding_window")
    if window is not None and hf.get("use_sliding_window", True) and window < hf["max_position_embeddings"]:
        refuse("sliding_window", f"sliding-window attention (window {window} < max_position_embeddings "
                                 f"{hf['max_position_embeddings']}) is not implemented")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            refuse(key, "projection biases are not implemented")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        refuse("partial_rotary_factor", "partial RoPE is not implemented")
    for key in ("rope_scaling", "rope_parameters"):
        rope = hf.get(key)
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default":
            refuse(key, "RoPE scaling (linear, dynamic, yarn, llama3, ...) is not implemented")
    if hf.get("pretraining_tp", 1) != 1:
        refuse("pretraining_tp", "set it to 1 (it only changes how HF splits the matmuls)")


def model_dict_to_hf_config(model: Dict[str, Any]) -> Dict[str, Any]:
    """moetrain `model:` section -> HF config.json (Mixtral for moe_gpt, Llama for gpt)."""
    cfg = build_config_from_dict(model)
    hf = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_hidden_size,
        "max_position_embeddings": cfg.seq_length,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if cfg.name == "gpt":
        hf.update(model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=False, mlp_bias=False)
        return hf
    if cfg.name != "moe_gpt":
        raise ValueError(f"model.name {cfg.name!r} has no Hugging Face format; hf-export handles gpt (Llama) "
                         f"and moe_gpt (Mixtral)")
    moe = cfg.moe

    def refuse(key, value, want):
        raise ValueError(f"model.{key}={value!r} cannot be expressed in the Mixtral format (needs {want})")

    if cfg.first_k_dense != 0:
        refuse("first_k_dense", cfg.first_k_dense, "0: every layer is MoE")
    if cfg.moe_layer_freq != 1:
        refuse("moe_layer_freq", cfg.moe_layer_freq, "1: every layer is MoE")
    if moe.num_shared_experts:
        refuse("moe.num_shared_experts", moe.num_shared_experts, "0")
    if moe.score_func != "softmax":
        refuse("moe.score_func", moe.score_func, "'softmax'")
    if not moe.norm_topk_prob:
        refuse("moe.norm_topk_prob", moe.norm_topk_prob, "true: Mixtral renormalises the top-k weights")
    if moe.route_scale != 1.0:
        refuse("moe.route_scale", moe.route_scale, "1.0")
    if moe.num_groups != 1:
        refuse("moe.num_groups", moe.num_groups, "1: no group-limited routing")
    hf.update(model_type="mixtral", architectures=["MixtralForCausalLM"], intermediate_size=moe.ffn_hidden_size,
              num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
              router_aux_loss_coef=moe.aux_loss_coeff, output_router_logits=False, router_jitter_noise=0.0,
              sliding_window=None)
    return hf


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------
def hf_to_state(hf: Dict[str, np.ndarray], model: Dict[str, Any]) -> Dict[str, np.ndarray]:
    """HF tensors -> moetrain state for the `model:` section `model` (from hf_config_to_model_dict)."""
    used = set()

    def take(name):
        if name not in hf:
            raise ValueError(f"the HF checkpoint has no tensor {name!r} (needed for a {model['name']} "
                             f"model with {model['num_layers']} layers)")
        used.add(name)
        return hf[name]

    state = {"embed.weight": take("model.embed_tokens.weight"), "final_norm.weight": take("model.norm.weight")}
    if not model["tie_embeddings"]:
        state["lm_head.weight"] = take("lm_head.weight")
    for i in range(model["num_layers"]):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for name, hf_name in _BLOCK_NAMES.items():
            state[ours + name] = take(theirs + hf_name)
        if model["name"] == "gpt":
            for name, hf_name in _DENSE_MLP_NAMES.items():
                state[ours + name] = take(theirs + hf_name)
            continue
        num_experts = model["moe"]["num_experts"]
        ffn = model["moe"]["ffn_hidden_size"]
        if theirs + "mlp.experts.gate_up_proj" in hf:
            state[ours + "moe.router.weight"] = take(theirs + "mlp.gate.weight")
            gate_up = take(theirs + "mlp.experts.gate_up_proj")                    # [E, 2F, H]
            state[ours + "moe.experts.w_gate"] = gate_up[:, :ffn].transpose(0, 2, 1)
            state[ours + "moe.experts.w_up"] = gate_up[:, ffn:].transpose(0, 2, 1)
            state[ours + "moe.experts.w_down"] = take(theirs + "mlp.experts.down_proj").transpose(0, 2, 1)
        else:
            moe = theirs + "block_sparse_moe."
            state[ours + "moe.router.weight"] = take(moe + "gate.weight")
            for name, hf_name in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")):
                state[f"{ours}moe.experts.{name}"] = np.stack(
                    [take(f"{moe}experts.{j}.{hf_name}.weight").T for j in range(num_experts)])
        state[ours + "moe.expert_bias"] = np.zeros(num_experts, np.float32)   # Mixtral routes without bias
    unused = sorted(n for n in set(hf) - used if not n.endswith(_IGNORED_SUFFIXES))
    if unused:
        raise ValueError(f"the HF checkpoint has tensors this {model['name']} model has no place for: "
                         f"{unused[:10]}{' ...' if len(unused) > 10 else ''} (another architecture?)")
    return {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in state.items()}


def state_to_hf(state: Dict[str, np.ndarray], model: Dict[str, Any], layout: str = "per_expert"):
    """moetrain state -> HF tensors (the inverse of `hf_to_state`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    hf = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["final_norm.weight"]}
    if not model["tie_embeddings"]:
        hf["lm_head.weight"] = state["lm_head.weight"]
    for i in range(model["num_layers"]):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for name, hf_name in _BLOCK_NAMES.items():
            hf[theirs + hf_name] = state[ours + name]
        if model["name"] == "gpt":
            for name, hf_name in _DENSE_MLP_NAMES.items():
                hf[theirs + hf_name] = state[ours + name]
            continue
        bias = state[ours + "moe.expert_bias"]
        if np.any(bias != 0):
            raise ValueError(f"{ours}moe.expert_bias is non-zero (aux-loss-free balancing): Mixtral routing has "
                             f"no expert bias, so the exported model would choose different experts")
        w_gate, w_up, w_down = (state[f"{ours}moe.experts.{n}"] for n in ("w_gate", "w_up", "w_down"))
        if layout == "fused":
            hf[theirs + "mlp.gate.weight"] = state[ours + "moe.router.weight"]
            hf[theirs + "mlp.experts.gate_up_proj"] = np.concatenate(
                [w_gate.transpose(0, 2, 1), w_up.transpose(0, 2, 1)], axis=1)
            hf[theirs + "mlp.experts.down_proj"] = w_down.transpose(0, 2, 1)
        else:
            moe = theirs + "block_sparse_moe."
            hf[moe + "gate.weight"] = state[ours + "moe.router.weight"]
            for j in range(w_gate.shape[0]):
                hf[f"{moe}experts.{j}.w1.weight"] = w_gate[j].T
                hf[f"{moe}experts.{j}.w3.weight"] = w_up[j].T
                hf[f"{moe}experts.{j}.w2.weight"] = w_down[j].T
    return {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in hf.items()}


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------
def hf_import(hf_dir: str, out_dir: str, check: bool = True) -> Dict[str, Any]:
    """HF checkpoint directory -> moetrain model directory; returns the `model:` section.

    With `check`, the model is built and the weights loaded strictly (names and shapes)."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{hf_dir!r} is not a Hugging Face checkpoint: config.json is missing")
    with open(config_path) as fh:
        model = hf_config_to_model_dict(json.load(fh))
    state = hf_to_state(load_hf_weights(hf_dir), model)
    if check:
        from moetrain.checkpoint.model_dir import build_model_from_dict, load_model_state

        load_model_state(build_model_from_dict(model), state, strict=True)
    save_model_dir(out_dir, {"model": model}, state)
    return model


def hf_export(model_dir: str, out_dir: str, layout: str = "per_expert") -> Dict[str, Any]:
    """moetrain model directory (or training checkpoint) -> HF config.json + model.safetensors."""
    from safetensors.numpy import save_file

    config_dict, state = load_model_dir(model_dir)
    model = dataclasses.asdict(build_config_from_dict(config_dict["model"]))
    hf_config = model_dict_to_hf_config(model)
    tensors = state_to_hf(state, model, layout)
    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, weights + ".tmp", metadata={"format": "pt"})   # transformers requires "pt"
    os.replace(weights + ".tmp", weights)
    _write_atomic_json(os.path.join(out_dir, "config.json"), hf_config)
    return hf_config


def _run(fn, argv) -> int:
    try:
        fn(argv)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"moetrain convert: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main_import(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moetrain convert hf-import",
                                 description="Hugging Face Mixtral/Llama checkpoint -> moetrain model directory")
    ap.add_argument("hf_dir", help="folder with config.json and *.safetensors")
    ap.add_argument("out_dir", help="model directory to write (config.yaml + model.safetensors)")

    def go(args):
        args = ap.parse_args(args)
        model = hf_import(args.hf_dir, args.out_dir)
        print(f"wrote {args.out_dir}: model {model['name']}, {model['num_layers']} layers")

    return _run(go, argv)


def main_export(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moetrain convert hf-export",
                                 description="moetrain model directory -> Hugging Face Mixtral/Llama checkpoint")
    ap.add_argument("ckpt_dir", help="model directory or training checkpoint folder")
    ap.add_argument("out_dir", help="folder to write config.json and model.safetensors to")
    ap.add_argument("--layout", choices=LAYOUTS, default="per_expert",
                    help="Mixtral expert tensors: per_expert (transformers < 5) or fused (transformers >= 5)")

    def go(args):
        args = ap.parse_args(args)
        hf_config = hf_export(args.ckpt_dir, args.out_dir, args.layout)
        print(f"wrote {args.out_dir}: {hf_config['architectures'][0]} ({args.layout} layout)")

    return _run(go, argv)


if __name__ == "__main__":   # python -m moetrain.checkpoint.hf {hf-import,hf-export} ...
    commands = {"hf-import": main_import, "hf-export": main_export}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: python -m moetrain.checkpoint.hf {{{','.join(commands)}}} ...")
    sys.exit(commands[sys.argv[1]](sys.argv[2:]))
