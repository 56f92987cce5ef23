"""Hugging Face interchange: tiny random Mixtral / Llama checkpoints built in numpy, imported,
run with `moetrain forward`, compared with the numpy reference, exported and re-imported.
(Parity with transformers itself: tests/test_hf_golden.py, against committed golden files.)"""
import json
import os
import struct
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_gpt import ref_logits  # noqa: E402  (the float64 Llama/Mixtral reference)

MIXTRAL_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 40, "hidden_size": 24,
    "intermediate_size": 20, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 6, "hidden_act": "silu", "max_position_embeddings": 32, "rms_norm_eps": 1e-5,
    "rope_theta": 1000.0, "tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.02, "sliding_window": None, "initializer_range": 0.02,
    "output_router_logits": False, "router_jitter_noise": 0.0, "attention_dropout": 0.0,
    "torch_dtype": "bfloat16", "use_cache": True,
}
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 40, "hidden_size": 24,
    "intermediate_size": 36, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
    "hidden_act": "silu", "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
}


def random_hf_weights(cfg, seed=0, scale=0.3):
    """Per-expert (Mixtral) or Llama tensors in HF names and `[out, in]` layout, fp32."""
    rng = np.random.default_rng(seed)
    H, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or H // heads

    def rand(*shape):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    def norm():
        return (1 + scale * rng.standard_normal(H)).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(V, H), "model.norm.weight": norm()}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rand(V, H)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                  p + "self_attn.q_proj.weight": rand(heads * d, H), p + "self_attn.k_proj.weight": rand(kv * d, H),
                  p + "self_attn.v_proj.weight": rand(kv * d, H), p + "self_attn.o_proj.weight": rand(H, heads * d)})
        if cfg["model_type"] == "mixtral":
            w[p + "block_sparse_moe.gate.weight"] = rand(cfg["num_local_experts"], H)
            for e in range(cfg["num_local_experts"]):
                q = f"{p}block_sparse_moe.experts.{e}."
                w.update({q + "w1.weight": rand(F, H), q + "w3.weight": rand(F, H), q + "w2.weight": rand(H, F)})
        else:
            w.update({p + "mlp.gate_proj.weight": rand(F, H), p + "mlp.up_proj.weight": rand(F, H),
                      p + "mlp.down_proj.weight": rand(H, F)})
    return w


def to_fused(w, cfg):
    """Per-expert Mixtral tensors -> the transformers >= 5 fused layout (written out independently)."""
    out = {k: v for k, v in w.items() if ".block_sparse_moe." not in k}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        experts = range(cfg["num_local_experts"])
        out[p + "mlp.gate.weight"] = w[p + "block_sparse_moe.gate.weight"]
        out[p + "mlp.experts.gate_up_proj"] = np.stack([np.concatenate(
            [w[f"{p}block_sparse_moe.experts.{e}.w1.weight"], w[f"{p}block_sparse_moe.experts.{e}.w3.weight"]])
            for e in experts])
        out[p + "mlp.experts.down_proj"] = np.stack([w[f"{p}block_sparse_moe.experts.{e}.w2.weight"] for e in experts])
    return out


def write_safetensors_raw(path, tensors, dtype="F32"):
    """Minimal safetensors writer (F32 or BF16 by truncation), independent of the code under test."""
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        value = np.ascontiguousarray(value, np.float32)
        blob = (value.view(np.uint32) >> 16).astype("<u2").tobytes() if dtype == "BF16" else value.astype("<f4").tobytes()
        header[name] = {"dtype": dtype, "shape": list(value.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header_bytes = json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header_bytes)) + header_bytes + b"".join(blobs))


def write_hf_checkpoint(path, cfg, tensors, shards=1, dtype="F32"):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    names = sorted(tensors)
    if shards == 1:
        write_safetensors_raw(os.path.join(path, "model.safetensors"), tensors, dtype)
        return
    weight_map = {}
    for s, part in enumerate(np.array_split(np.array(names), shards)):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors_raw(os.path.join(path, file), {n: tensors[n] for n in part}, dtype)
        weight_map.update({n: file for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)


def read_hf(path):
    from safetensors.numpy import load_file

    with open(os.path.join(path, "config.json")) as fh:
        return json.load(fh), load_file(os.path.join(path, "model.safetensors"))


@pytest.fixture(scope="module")
def ms():
    import mindspore

    mindspore.set_device("CPU")
    return mindspore


def run_cli_forward(ckpt, ids, tmp_path):
    from moetrain.forward import main

    np.save(tmp_path / "ids.npy", ids)
    assert main([str(ckpt), "--input", str(tmp_path / "ids.npy"), "--output", str(tmp_path / "logits.npy"),
                 "--batch-size", "2"]) == 0
    return np.load(tmp_path / "logits.npy")


@pytest.mark.parametrize("layout,shards", [("per_expert", 1), ("fused", 2)])
def test_mixtral_import_forward_matches_reference(ms, tmp_path, layout, shards):
    from moetrain.checkpoint.hf import main_import

    weights = random_hf_weights(MIXTRAL_CONFIG, seed=1)
    on_disk = weights if layout == "per_expert" else to_fused(weights, MIXTRAL_CONFIG)
    write_hf_checkpoint(tmp_path / "hf", MIXTRAL_CONFIG, on_disk, shards=shards)
    assert main_import([str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0

    ids = np.random.default_rng(0).integers(0, MIXTRAL_CONFIG["vocab_size"], (3, 9)).astype(np.int64)
    logits = run_cli_forward(tmp_path / "ckpt", ids, tmp_path)
    expected = ref_logits(weights, MIXTRAL_CONFIG, ids)
    assert logits.dtype == np.float32 and logits.shape == (3, 9, MIXTRAL_CONFIG["vocab_size"])
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=2e-5)


def test_imported_config(tmp_path):
    from moetrain.checkpoint.hf import hf_config_to_model_dict

    model = hf_config_to_model_dict(MIXTRAL_CONFIG)
    assert model["name"] == "moe_gpt"
    assert (model["num_layers"], model["num_heads"], model["num_kv_heads"], model["head_dim"]) == (2, 4, 2, 6)
    assert (model["rope_theta"], model["norm_eps"], model["seq_length"]) == (1000.0, 1e-5, 32)
    assert (model["first_k_dense"], model["moe_layer_freq"]) == (0, 1)
    moe = model["moe"]
    assert (moe["num_experts"], moe["top_k"], moe["ffn_hidden_size"]) == (4, 2, 20)
    assert (moe["score_func"], moe["norm_topk_prob"], moe["capacity_factor"], moe["num_shared_experts"]) == \
        ("softmax", True, 0.0, 0)
    assert moe["aux_loss_coeff"] == 0.02
    v5 = dict(MIXTRAL_CONFIG, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    del v5["rope_theta"]
    assert hf_config_to_model_dict(v5)["rope_theta"] == 5e5


def test_rope_and_window_keys_are_read_as_transformers_5_reads_them():
    """transformers 5 (configuration_utils / modeling_rope_utils, checked with 5.23.0): a legacy
    `rope_scaling` object replaces `rope_parameters` whole; theta comes from that object, else the
    top-level `rope_theta`, else the family's `default_theta` (Mixtral 1e6, others 1e4); YaRN's original
    length defaults to max_position_embeddings, a top-level key overriding it; a Qwen3-MoE window is
    used only with use_sliding_window, a Mistral's defaults to 4096; Mistral's eps defaults to 1e-6."""
    from moetrain.checkpoint.hf import hf_config_to_model_dict

    def read(base, drop=(), **keys):
        config = {k: v for k, v in base.items() if k not in drop}
        return hf_config_to_model_dict(dict(config, **keys))

    bare = ("rope_theta", "rope_parameters", "rope_scaling")
    assert read(MIXTRAL_CONFIG, bare)["rope_theta"] == 1e6
    assert read(LLAMA_CONFIG, bare)["rope_theta"] == 1e4
    assert read(LLAMA_CONFIG, bare, rope_scaling={"type": "default", "rope_theta": 5.0},
                rope_parameters={"rope_type": "default", "rope_theta": 5e5})["rope_theta"] == 5.0
    assert read(LLAMA_CONFIG, rope_scaling={"type": "default"},
                rope_parameters={"rope_type": "default", "rope_theta": 5e5})["rope_theta"] == 1e4   # top-level
    assert read(LLAMA_CONFIG, rope_scaling=None, rope_parameters={"rope_type": "default", "rope_theta": 5e5})[
        "rope_theta"] == 5e5
    with pytest.raises(ValueError, match=r"config.json: rope_scaling=\{\"type\": \"linear\".*'linear' is not implemented"):
        read(LLAMA_CONFIG, rope_scaling={"type": "linear", "factor": 2.0},
             rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    with pytest.raises(ValueError, match="config.json: rope_parameters=.*per layer type"):
        read(LLAMA_CONFIG, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="config.json: rope_parameters=.*partial RoPE"):
        read(LLAMA_CONFIG, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    assert read(LLAMA_CONFIG, partial_rotary_factor=None)["name"] == "gpt"

    with open(os.path.join(os.path.dirname(__file__), "golden", "deepseek_v3_yarn", "config.json")) as fh:
        deepseek = json.load(fh)
    yarn = {k: v for k, v in deepseek["rope_parameters"].items() if k not in ("rope_type", "rope_theta")}
    assert read(deepseek, ("rope_parameters",), rope_scaling=dict(yarn, type="yarn"), rope_theta=5e4)[
        "rope_theta"] == 5e4                                   # as published DeepSeek-V3 config.json has it
    del yarn["original_max_position_embeddings"]
    legacy = dict(yarn, type="yarn")
    assert read(deepseek, rope_scaling=legacy)["yarn_original_max_positions"] == deepseek["max_position_embeddings"]
    assert read(deepseek, rope_scaling=legacy, original_max_position_embeddings=4)["yarn_original_max_positions"] == 4
    assert read(deepseek, original_max_position_embeddings=4)["yarn_original_max_positions"] == 4
    with pytest.raises(ValueError, match="YaRN needs its scaling factor"):
        read(deepseek, rope_scaling=dict(legacy, factor=None))

    qwen = {"model_type": "qwen3_moe", "vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 24, "moe_intermediate_size": 8,
            "max_position_embeddings": 32768, "num_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4096}
    assert read(qwen)["name"] == "qwen3_moe"                  # use_sliding_window defaults to false
    with pytest.raises(ValueError, match="config.json: sliding_window=4096"):
        read(qwen, use_sliding_window=True)
    mistral = dict(LLAMA_CONFIG, model_type="mistral", max_position_embeddings=32768)
    with pytest.raises(ValueError, match="config.json: sliding_window is absent, so mistral's default 4096 applies"):
        read(mistral, ("rms_norm_eps",))
    mistral = read(mistral, ("rms_norm_eps",), sliding_window=None)
    assert mistral["norm_eps"] == 1e-6


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_export_then_import_is_lossless(ms, tmp_path, layout):
    from moetrain.checkpoint.hf import hf_export, hf_import
    from moetrain.checkpoint.model_dir import load_model_dir

    weights = random_hf_weights(MIXTRAL_CONFIG, seed=2)
    original = weights if layout == "per_expert" else to_fused(weights, MIXTRAL_CONFIG)
    write_hf_checkpoint(tmp_path / "hf", MIXTRAL_CONFIG, original)
    hf_import(str(tmp_path / "hf"), str(tmp_path / "a"))
    hf_export(str(tmp_path / "a"), str(tmp_path / "hf2"), layout=layout)
    exported_config, exported = read_hf(tmp_path / "hf2")
    # HF -> moetrain -> HF reproduces every tensor bit for bit, in the same layout.
    assert set(exported) == set(original)
    for name, value in original.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    # ... and every config key moetrain models (torch_dtype aside: export writes fp32).
    for key, value in MIXTRAL_CONFIG.items():
        if key != "torch_dtype":
            assert exported_config[key] == value, key
    # moetrain -> HF -> moetrain is the identity on the model directory.
    hf_import(str(tmp_path / "hf2"), str(tmp_path / "b"))
    config_a, state_a = load_model_dir(str(tmp_path / "a"))
    config_b, state_b = load_model_dir(str(tmp_path / "b"))
    assert config_a == config_b and set(state_a) == set(state_b)
    for name in state_a:
        np.testing.assert_array_equal(state_a[name], state_b[name], err_msg=name)
    # Exporting again gives the same config.json: it round-trips.
    hf_export(str(tmp_path / "b"), str(tmp_path / "hf3"), layout=layout)
    assert read_hf(tmp_path / "hf3")[0] == exported_config


def test_layouts_convert_into_each_other(ms, tmp_path):
    from moetrain.checkpoint.hf import hf_import, main_export

    weights = random_hf_weights(MIXTRAL_CONFIG, seed=3)
    write_hf_checkpoint(tmp_path / "hf", MIXTRAL_CONFIG, weights)
    hf_import(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert main_export([str(tmp_path / "ckpt"), str(tmp_path / "fused"), "--layout", "fused"]) == 0
    _, fused = read_hf(tmp_path / "fused")
    expected = to_fused(weights, MIXTRAL_CONFIG)
    assert set(fused) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(fused[name], value, err_msg=name)


def test_bf16_llama_import_forward_and_export(ms, tmp_path):
    from moetrain.checkpoint.hf import hf_export, hf_import

    weights = random_hf_weights(LLAMA_CONFIG, seed=4)
    # bf16 keeps the top 16 bits of each fp32: the values the model must end up with.
    truncated = {k: (v.view(np.uint32) & 0xFFFF0000).view(np.float32) for k, v in weights.items()}
    write_hf_checkpoint(tmp_path / "hf", LLAMA_CONFIG, weights, shards=3, dtype="BF16")
    model = hf_import(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert model["name"] == "gpt" and model["tie_embeddings"] and model["num_kv_heads"] == 1

    ids = np.random.default_rng(1).integers(0, LLAMA_CONFIG["vocab_size"], (2, 12)).astype(np.int32)
    logits = run_cli_forward(tmp_path / "ckpt", ids, tmp_path)
    np.testing.assert_allclose(logits, ref_logits(truncated, LLAMA_CONFIG, ids), rtol=1e-5, atol=2e-5)

    hf_export(str(tmp_path / "ckpt"), str(tmp_path / "hf2"))
    config, exported = read_hf(tmp_path / "hf2")
    assert set(exported) == set(truncated) and "lm_head.weight" not in exported
    for name, value in truncated.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    assert config["model_type"] == "llama" and config["head_dim"] == 6
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings"):
        assert config[key] == LLAMA_CONFIG[key], key


@pytest.mark.parametrize("change,key", [
    ({"sliding_window": 8}, "sliding_window"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_parameters"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "qwen2_moe"}, "model_type"),
])
def test_unsupported_hf_configs_name_the_key(change, key):
    from moetrain.checkpoint.hf import hf_config_to_model_dict

    with pytest.raises(ValueError, match=f"config.json: {key}"):
        hf_config_to_model_dict(dict(MIXTRAL_CONFIG, **change))
    # a window that covers every position is plain causal attention
    assert hf_config_to_model_dict(dict(MIXTRAL_CONFIG, sliding_window=32))["name"] == "moe_gpt"


def test_import_reports_missing_and_unexpected_tensors(tmp_path):
    from moetrain.checkpoint.hf import hf_config_to_model_dict, hf_to_state

    model = hf_config_to_model_dict(MIXTRAL_CONFIG)
    weights = random_hf_weights(MIXTRAL_CONFIG, seed=5)
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"no tensor 'model.layers.1.self_attn.k_proj.weight'"):
        hf_to_state(missing, model)
    with pytest.raises(ValueError, match=r"no place for: \['model.layers.0.self_attn.q_proj.bias'\]"):
        hf_to_state(dict(weights, **{"model.layers.0.self_attn.q_proj.bias": np.zeros(24, np.float32)}), model)


def test_export_refuses_what_mixtral_cannot_express(ms, tmp_path):
    from moetrain.checkpoint.hf import hf_config_to_model_dict, hf_export, hf_import, model_dict_to_hf_config
    from moetrain.checkpoint.model_dir import load_model_dir, save_model_dir

    model = hf_config_to_model_dict(MIXTRAL_CONFIG)
    for key, value, message in (("first_k_dense", 1, "model.first_k_dense=1"),
                                ("moe_layer_freq", 2, "model.moe_layer_freq=2")):
        with pytest.raises(ValueError, match=message):
            model_dict_to_hf_config(dict(model, **{key: value}))
    with pytest.raises(ValueError, match="model.moe.score_func='sigmoid'"):
        model_dict_to_hf_config(dict(model, moe=dict(model["moe"], score_func="sigmoid")))

    write_hf_checkpoint(tmp_path / "hf", MIXTRAL_CONFIG, random_hf_weights(MIXTRAL_CONFIG, seed=6))
    hf_import(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    config, state = load_model_dir(str(tmp_path / "ckpt"))
    state["layers.1.moe.expert_bias"] = np.array([0.0, 0.1, 0.0, 0.0], np.float32)
    save_model_dir(str(tmp_path / "biased"), config, state)
    with pytest.raises(ValueError, match="layers.1.moe.expert_bias is non-zero"):
        hf_export(str(tmp_path / "biased"), str(tmp_path / "out"))


def test_forward_rejects_bad_input(ms, tmp_path):
    from moetrain.checkpoint.hf import hf_import
    from moetrain.forward import run_forward

    write_hf_checkpoint(tmp_path / "hf", LLAMA_CONFIG, random_hf_weights(LLAMA_CONFIG, seed=7))
    hf_import(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    np.save(tmp_path / "bad.npy", np.array([[1, 2, 40]]))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 40\)"):
        run_forward(str(tmp_path / "ckpt"), str(tmp_path / "bad.npy"), str(tmp_path / "out.npy"))
    np.save(tmp_path / "float.npy", np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match="must be integers"):
        run_forward(str(tmp_path / "ckpt"), str(tmp_path / "float.npy"), str(tmp_path / "out.npy"))
