"""Parity with transformers through committed golden files (tests/golden, made by tools/make_hf_golden.py
with the versions in tests/golden/VERSIONS.json): tiny Llama, Mixtral, Qwen3-MoE and DeepSeek-V3
checkpoints as transformers saves them, with their float32 logits. No torch needed here.

Each is imported in both expert layouts (the per-expert names transformers writes, as published
checkpoints have them, and the fused names transformers 5 holds in memory) and must give the golden
logits within 1e-4; DeepSeek-V3's multi-token-prediction layer must give transformers' MTP logits;
export must give back the published tensors under their names; leftovers must be named."""
import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
MODELS = ("llama", "mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v3_yarn")
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def ms():
    import mindspore

    from moetrain.distributed.topology import cpu_ops_on_calling_thread

    mindspore.set_device("CPU")
    cpu_ops_on_calling_thread()      # as `moetrain generate` does: op-by-op decoding without a spinning queue
    return mindspore


def golden(name, file):
    path = os.path.join(GOLDEN, name, file)
    if file.endswith(".npy"):
        return np.load(path)
    if file.endswith(".json"):
        with open(path) as fh:
            return json.load(fh)
    return load_file(path)


def to_fused(tensors, config):
    """Per-expert tensors -> the fused layout, written out here independently of moetrain/checkpoint/hf.py:
    `mlp.experts.gate_up_proj [E, 2F, H]` (gate rows, then up) and `mlp.experts.down_proj [E, H, F]`."""
    mixtral = config["model_type"] == "mixtral"
    out, experts = {}, {}
    for name, value in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            layer_prefix = ".".join(parts[:i - 1]) + ".mlp.experts."
            kind = {"w1": "gate", "w3": "up", "w2": "down"}.get(parts[i + 2], parts[i + 2].replace("_proj", ""))
            experts.setdefault(layer_prefix, {}).setdefault(kind, {})[int(parts[i + 1])] = value
        elif mixtral and ".block_sparse_moe.gate." in name:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = value
        else:
            out[name] = value
    for prefix, kinds in experts.items():
        count = len(kinds["gate"])
        out[prefix + "gate_up_proj"] = np.stack([np.concatenate([kinds["gate"][j], kinds["up"][j]]) for j in range(count)])
        out[prefix + "down_proj"] = np.stack([kinds["down"][j] for j in range(count)])
    return out


def write_hf(path, name, tensors):
    os.makedirs(path, exist_ok=True)
    shutil.copy(os.path.join(GOLDEN, name, "config.json"), path / "config.json")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_fused_layout_is_what_transformers_holds():
    """The independent fused conversion above gives transformers 5's in-memory names and shapes."""
    for name in ("mixtral", "qwen3_moe", "deepseek_v3"):
        config = golden(name, "config.json")
        fused = to_fused(golden(name, "model.safetensors"), config)
        main = {k: list(v.shape) for k, v in fused.items()
                if not k.startswith(f"model.layers.{config['num_hidden_layers']}.")}   # MTP layer: not in the model
        expected = {k: v for k, v in golden(name, "fused_names.json").items() if not k.endswith("inv_freq")}
        if config.get("tie_word_embeddings"):
            main.setdefault("lm_head.weight", expected.get("lm_head.weight"))
        assert main == expected, name


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("name", MODELS)
def test_import_reproduces_transformers_logits(ms, tmp_path, name, layout):
    from moetrain.checkpoint.hf import hf_import
    from moetrain.checkpoint.model_dir import load_model

    tensors = golden(name, "model.safetensors")
    if layout == "fused":
        if name == "llama":
            pytest.skip("a dense model has one layout")
        tensors = to_fused(tensors, golden(name, "config.json"))
    write_hf(tmp_path / "hf", name, tensors)
    hf_import(str(tmp_path / "hf"), str(tmp_path / "model"))
    model, _ = load_model(str(tmp_path / "model"))
    ids = golden(name, "input_ids.npy")
    logits = model.logits(ms.Tensor(ids)).asnumpy()
    np.testing.assert_allclose(logits, golden(name, "logits.npy"), rtol=0, atol=TOLERANCE)
    if name == "deepseek_v3":   # the MTP layer: depth 1 from the main stack's last hidden state
        labels = ms.Tensor(golden(name, "labels.npy"))
        h, _, _ = model.run_layers(model.embed(ms.Tensor(ids)))
        _, mtp_logits, _ = model.mtp_depth_step(0, h, labels)
        np.testing.assert_allclose(mtp_logits.asnumpy(), golden(name, "mtp_logits.npy"), rtol=0, atol=TOLERANCE)


def test_deepseek_v3_as_transformers_saves_it(ms, tmp_path, capsys):
    """transformers' DeepseekV3ForCausalLM holds no MTP layer, so `save_pretrained` writes none of its
    tensors while config.json keeps `num_nextn_predict_layers: 1`: import without it (one line says
    so) and reproduce transformers' logits; `init_missing_layers` adds fresh MTP layers instead."""
    from moetrain.checkpoint.hf import hf_import
    from moetrain.checkpoint.model_dir import load_model, load_model_dir

    saved = os.path.join(GOLDEN, "deepseek_v3_saved")
    config = golden("deepseek_v3_saved", "config.json")
    assert config["num_nextn_predict_layers"] == 1
    assert not any(k.startswith(f"model.layers.{config['num_hidden_layers']}.") for k in golden("deepseek_v3_saved", "model.safetensors"))
    model_section = hf_import(saved, str(tmp_path / "model"))
    assert model_section["mtp_depth"] == 0
    assert "num_nextn_predict_layers=1 but the checkpoint holds 0 MTP layer(s)" in capsys.readouterr().out
    ids = golden("deepseek_v3_saved", "input_ids.npy")
    expected = golden("deepseek_v3_saved", "logits.npy")
    model, _ = load_model(str(tmp_path / "model"))
    np.testing.assert_allclose(model.logits(ms.Tensor(ids)).asnumpy(), expected, rtol=1e-5, atol=1e-5)

    model_section = hf_import(saved, str(tmp_path / "with_mtp"), init_missing_layers=True)
    assert model_section["mtp_depth"] == 1 and "initialised fresh" in capsys.readouterr().out
    _, state = load_model_dir(str(tmp_path / "with_mtp"))
    assert state["mtp.0.eh_proj.weight"].std() > 0
    model, _ = load_model(str(tmp_path / "with_mtp"))
    np.testing.assert_allclose(model.logits(ms.Tensor(ids)).asnumpy(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3_saved"])
def test_greedy_generate_equals_transformers(ms, tmp_path, name):
    """32 greedy tokens after 8 prompt tokens, token for token as transformers' `generate(do_sample=False)`
    (generate_ids.npy), through the KV cache (DeepSeek-V3: the MLA latent cache; cached logits against
    a full forward's: tests/test_generate.py). The model is built with 64 positions: max_position_embeddings (32)
    holds no weights, and transformers' RoPE runs past it too."""
    from moetrain.checkpoint.hf import hf_import
    from moetrain.checkpoint.model_dir import build_model_from_dict, load_model_dir, load_model_state
    from moetrain.generate import generate_ids

    expected = golden(name, "generate_ids.npy")
    hf_import(os.path.join(GOLDEN, name), str(tmp_path / "model"))
    config, state = load_model_dir(str(tmp_path / "model"))
    model = build_model_from_dict(dict(config["model"], seq_length=64))
    load_model_state(model, state, strict=True)
    prompt = expected[:, :8]
    ids = generate_ids(model, prompt, max_new_tokens=expected.shape[1] - 8, temperature=0.0)
    np.testing.assert_array_equal(ids, expected)


def test_imported_deepseek_config():
    from moetrain.checkpoint.hf import hf_config_to_model_dict

    model = hf_config_to_model_dict(golden("deepseek_v3", "config.json"))
    assert (model["name"], model["q_lora_rank"], model["kv_lora_rank"], model["mtp_depth"]) == ("deepseek_v3", 24, 16, 1)
    assert (model["first_k_dense"], model["head_dim"], model["num_kv_heads"], model["rope_interleave"]) == (1, 12, 4, True)
    moe = model["moe"]
    assert (moe["score_func"], moe["num_groups"], moe["topk_groups"], moe["group_score_topk"]) == ("sigmoid", 4, 2, 2)
    assert (moe["route_scale"], moe["num_shared_experts"], moe["norm_topk_prob"]) == (2.5, 1, True)
    assert moe["bias_update_rate"] > 0 and moe["aux_loss_coeff"] == 0
    yarn = hf_config_to_model_dict(golden("deepseek_v3_yarn", "config.json"))
    assert (yarn["q_lora_rank"], yarn["yarn_factor"], yarn["yarn_original_max_positions"], yarn["yarn_mscale_all_dim"]) == \
        (0, 4.0, 8, 0.7)
    qwen = hf_config_to_model_dict(golden("qwen3_moe", "config.json"))
    assert (qwen["head_dim"], qwen["mlp_only_layers"], qwen["moe"]["norm_topk_prob"], qwen["moe"]["num_experts"]) == \
        (12, [1], False, 4)


@pytest.mark.parametrize("name", ("mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v3_yarn"))
def test_export_gives_back_the_published_tensors(ms, tmp_path, name):
    from moetrain.checkpoint.hf import hf_config_to_model_dict, hf_export, hf_import

    published = golden(name, "model.safetensors")
    write_hf(tmp_path / "hf", name, published)
    model = hf_import(str(tmp_path / "hf"), str(tmp_path / "model"))
    for layout, expected in (("per_expert", published), ("fused", to_fused(published, golden(name, "config.json")))):
        config = hf_export(str(tmp_path / "model"), str(tmp_path / layout), layout=layout)
        exported = load_file(str(tmp_path / layout / "model.safetensors"))
        assert sorted(exported) == sorted(expected), layout
        for key, value in expected.items():
            np.testing.assert_array_equal(exported[key], value, err_msg=f"{layout}: {key}")
        assert hf_config_to_model_dict(config) == model       # the exported config.json describes the same model


def test_leftover_tensors_fail_naming_them(tmp_path):
    from moetrain.checkpoint.hf import hf_import

    tensors = golden("deepseek_v3", "model.safetensors")
    extra = dict(tensors, **{"model.layers.1.mlp.experts.8.gate_proj.weight": np.zeros((16, 32), np.float32)})
    write_hf(tmp_path / "extra", "deepseek_v3", extra)
    with pytest.raises(ValueError, match=r"no place for: \['model.layers.1.mlp.experts.8.gate_proj.weight'\]"):
        hf_import(str(tmp_path / "extra"), str(tmp_path / "out"))
    # A config without the MTP layer leaves every tensor of layer 2 (the MTP layer) unconsumed.
    write_hf(tmp_path / "no_mtp", "deepseek_v3", tensors)
    config = golden("deepseek_v3", "config.json")
    with open(tmp_path / "no_mtp" / "config.json", "w") as fh:
        json.dump(dict(config, num_nextn_predict_layers=0), fh)
    with pytest.raises(ValueError, match=r"no place for: \['model.layers.2.eh_proj.weight', 'model.layers.2.embed_tokens"):
        hf_import(str(tmp_path / "no_mtp"), str(tmp_path / "out2"))
    # The MTP copy of the embedding must be a copy: moetrain shares it.
    changed = dict(tensors, **{"model.layers.2.embed_tokens.weight": tensors["model.embed_tokens.weight"] + 1})
    write_hf(tmp_path / "changed", "deepseek_v3", changed)
    with pytest.raises(ValueError, match="model.layers.2.embed_tokens.weight' differs"):
        hf_import(str(tmp_path / "changed"), str(tmp_path / "out3"))
    assert not os.path.exists(tmp_path / "out3")     # found while streaming: the unfinished output is removed


def test_fp8_blocks_are_dequantized_as_torch_does(tmp_path):
    from moetrain.checkpoint.hf_io import E4M3_TO_FP32, HFSource, load_hf_weights

    folder = os.path.join(GOLDEN, "fp8_block")
    with open(os.path.join(folder, "config.json")) as fh:
        quantization = json.load(fh)["quantization_config"]
    weights = load_hf_weights(folder, quantization)
    assert sorted(weights) == ["norm.weight", "proj.weight"]          # the scale is consumed
    np.testing.assert_array_equal(weights["proj.weight"], np.load(os.path.join(folder, "dequantized.npy")))
    streamed = HFSource(folder, quantization)      # what hf-import reads: one tensor at a time
    assert sorted(streamed.keys()) == sorted(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(streamed.get(name), value)
    assert E4M3_TO_FP32[0x7E] == 448.0 and E4M3_TO_FP32[0x01] == 2.0 ** -9 and np.isnan(E4M3_TO_FP32[0xFF])
    # A quantized weight without its scale cannot be dequantized: named.
    from moetrain.checkpoint.hf_io import dequantize_fp8_blocks

    fp8 = {"w.weight": np.zeros((4, 4), np.uint8)}
    with pytest.raises(ValueError, match="FP8 tensor 'w.weight' has no 'w.weight_scale_inv'"):
        dequantize_fp8_blocks(fp8, ["w.weight"], (128, 128))
    with pytest.raises(ValueError, match=r"scale tensors without an FP8 weight: \['v.weight_scale_inv'\]"):
        dequantize_fp8_blocks({"v.weight_scale_inv": np.ones((1, 1), np.float32)}, [], (128, 128))


# ---------------------------------------------------------------------------------------------
# What save_pretrained writes, in the variants that change how a folder is read
# (tools/make_hf_golden.py VARIANTS; tests/golden/README.md)
# ---------------------------------------------------------------------------------------------
VARIANTS = ("llama_legacy_rope", "mixtral_tied_default_rope", "qwen3_moe_sparse_step", "deepseek_v3_legacy_yarn")


def published_tensors(name):
    """Every tensor of a golden folder, from its shards when it has an index."""
    folder = os.path.join(GOLDEN, name)
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return load_file(os.path.join(folder, "model.safetensors"))
    with open(index) as fh:
        weight_map = json.load(fh)["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        tensors.update(load_file(os.path.join(folder, shard)))
    assert sorted(tensors) == sorted(weight_map) and len(set(weight_map.values())) > 1
    return tensors


@pytest.mark.parametrize("name", VARIANTS)
def test_what_save_pretrained_writes_imports_exports_and_reimports(ms, tmp_path, name):
    """Straight from the golden folder as transformers left it (shards + index, a tied head, legacy or
    absent RoPE keys, Qwen3-MoE's decoder_sparse_step with mlp_only_layers): the logits equal
    transformers' to 1e-5; export gives back every published tensor (one file) and a config.json that
    imports as the same model, with the same weights."""
    from moetrain.checkpoint.hf import hf_config_to_model_dict, hf_export, hf_import
    from moetrain.checkpoint.model_dir import load_model, load_model_dir

    model_section = hf_import(os.path.join(GOLDEN, name), str(tmp_path / "model"))
    model, _ = load_model(str(tmp_path / "model"))
    logits = model.logits(ms.Tensor(golden(name, "input_ids.npy"))).asnumpy()
    np.testing.assert_allclose(logits, golden(name, "logits.npy"), rtol=1e-5, atol=1e-5)

    config = hf_export(str(tmp_path / "model"), str(tmp_path / "exported"))
    exported, published = load_file(str(tmp_path / "exported" / "model.safetensors")), published_tensors(name)
    assert sorted(exported) == sorted(published)
    for key, value in published.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    assert hf_config_to_model_dict(config) == model_section
    hf_import(str(tmp_path / "exported"), str(tmp_path / "again"))
    (_, first), (_, again) = load_model_dir(str(tmp_path / "model")), load_model_dir(str(tmp_path / "again"))
    assert sorted(first) == sorted(again) and all(np.array_equal(first[k], again[k]) for k in first)


def test_what_the_variants_configs_mean():
    """The keys each variant exercises, read as transformers 5 reads them."""
    from moetrain.checkpoint.hf import hf_config_to_model_dict
    from moetrain.checkpoint.model_dir import build_config_from_dict

    llama = hf_config_to_model_dict(golden("llama_legacy_rope", "config.json"))     # transformers 4's keys
    assert (llama["rope_theta"], llama["tie_embeddings"]) == (500000.0, False)
    mixtral = hf_config_to_model_dict(golden("mixtral_tied_default_rope", "config.json"))   # no RoPE key at all
    assert (mixtral["rope_theta"], mixtral["tie_embeddings"]) == (1e6, True)
    qwen = hf_config_to_model_dict(golden("qwen3_moe_sparse_step", "config.json"))
    assert [build_config_from_dict(qwen).is_moe_layer(i) for i in range(4)] == [False, False, False, True]
    yarn = hf_config_to_model_dict(golden("deepseek_v3_legacy_yarn", "config.json"))   # {"type": "yarn"} legacy
    assert (yarn["rope_theta"], yarn["yarn_factor"], yarn["yarn_original_max_positions"]) == (1e4, 4.0, 8)
    assert (yarn["yarn_mscale"], yarn["yarn_mscale_all_dim"], yarn["tie_embeddings"]) == (1.0, 0.7, False)


@pytest.mark.parametrize("name,keys", [("llama_bias", "attention_bias=true, mlp_bias=true"),
                                       ("qwen3_moe_bias", "attention_bias=true")])
def test_projection_biases_are_refused_naming_the_keys(tmp_path, name, keys):
    """moetrain's attention and MLP projections have no biases: a config.json that has them (as
    save_pretrained writes it) stops the import at once, naming the file and the keys."""
    from moetrain.checkpoint.hf import hf_import

    folder = os.path.join(GOLDEN, name)
    with pytest.raises(ValueError) as info:
        hf_import(folder, str(tmp_path / "model"))
    message = str(info.value)
    assert message.startswith(f"{os.path.join(folder, 'config.json')}: {keys}: ") and "\n" not in message
    assert "biases" in message
    assert not os.path.exists(tmp_path / "model")


# ----------------------------------------------------------------------------------------------
# Streaming import (issue 32 item 2): tensor by tensor, never the whole model
# ----------------------------------------------------------------------------------------------
def whole_import(hf_dir, out_dir):
    """The import that holds the whole model: every HF tensor read (`load_hf_weights`), every
    moetrain tensor made (`hf_to_state`, whole tensor maps), then one `save_file` of the dict."""
    from moetrain.checkpoint.hf import _family_with_format, hf_config_to_model_dict, hf_to_state, load_hf_weights
    from moetrain.checkpoint.model_dir import build_config_from_dict
    from moetrain.checkpoint.model_files import save_model_dir

    with open(os.path.join(hf_dir, "config.json")) as fh:
        config = json.load(fh)
    model = hf_config_to_model_dict(config)
    hf = load_hf_weights(hf_dir, config.get("quantization_config"))
    missing = _family_with_format(build_config_from_dict(model)).hf.missing_layers(model, hf.keys())
    model = missing.held if missing else model
    save_model_dir(out_dir, {"model": model}, hf_to_state(hf, model))


def same_bytes(a, b):
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


@pytest.mark.parametrize("name,layout", [(n, "per_expert") for n in MODELS + VARIANTS + ("deepseek_v3_saved",)]
                         + [(n, "fused") for n in ("mixtral", "qwen3_moe", "deepseek_v3")])
def test_streamed_import_writes_the_whole_import_byte_for_byte(tmp_path, name, layout, capsys):
    """hf-import (one map part at a time, each tensor written to its place) gives the file the
    in-memory import gives, byte for byte: sharded goldens, fused experts, missing MTP layers."""
    from moetrain.checkpoint.hf import hf_import

    folder = os.path.join(GOLDEN, name)
    if layout == "fused":
        folder = str(tmp_path / "fused")
        write_hf(tmp_path / "fused", name, to_fused(golden(name, "model.safetensors"), golden(name, "config.json")))
    hf_import(folder, str(tmp_path / "streamed"))
    whole_import(folder, str(tmp_path / "whole"))
    assert same_bytes(tmp_path / "streamed" / "model.safetensors", tmp_path / "whole" / "model.safetensors")


def scaled_mixtral(path, layers=16, hidden=256, kv=128, ffn=512):
    """The golden Mixtral widened and deepened (2 -> `layers` layers, each golden dimension mapped to
    its new size), random float16 values, sharded one layer per file with transformers'
    `model.safetensors.index.json`, written by safetensors itself. Returns the fp32 bytes it imports to."""
    import re

    config = golden("mixtral", "config.json")
    dims = {config["hidden_size"]: hidden, config["num_key_value_heads"] * config["head_dim"]: kv,
            config["intermediate_size"]: ffn}
    assert len(dims) == 3 and config["num_local_experts"] not in dims and config["vocab_size"] not in dims
    head_dim = hidden // config["num_attention_heads"]
    config.update(hidden_size=hidden, intermediate_size=ffn, head_dim=head_dim, num_hidden_layers=layers,
                  num_key_value_heads=kv // head_dim)
    rng = np.random.default_rng(0)
    shards = {}
    for name, value in golden("mixtral", "model.safetensors").items():
        shape = tuple(dims.get(d, d) for d in value.shape)
        layer = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        copies = ([(f"model.layers.{i}.{layer.group(2)}", i + 1) for i in range(int(layer.group(1)), layers, 2)]
                  if layer else [(name, 0)])
        for new, shard in copies:
            shards.setdefault(shard, {})[new] = (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16)
    os.makedirs(path, exist_ok=True)
    weight_map, fp32_bytes = {}, 0
    for k, tensors in shards.items():
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        fp32_bytes += sum(2 * t.nbytes for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": fp32_bytes // 2}, "weight_map": weight_map}, fh)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    return fp32_bytes


STREAM_BUFFER = 6 << 20   # beside one map part: the deferred model's cells, headers, names (measured 2.4 MiB)


def test_import_of_a_sharded_checkpoint_streams_tensor_by_tensor(tmp_path, capsys):
    """A 16-layer Mixtral in 17 float16 shards (108 MiB in fp32) is imported under tracemalloc: the
    traced peak stays below two of its largest tensors (one expert bank's per-expert sources, then
    the bank) plus `STREAM_BUFFER`, an eighth of the model, and the result is the in-memory import's
    byte for byte."""
    import tracemalloc

    from moetrain.checkpoint.hf import hf_config_to_model_dict, hf_import

    total = scaled_mixtral(str(tmp_path / "hf"))
    largest = 4 * 4 * 256 * 512          # one layer's w_gate [E, H, F] fp32
    hf_config_to_model_dict(golden("mixtral", "config.json"))     # the model registry, imported before tracing
    tracemalloc.start()
    try:
        hf_import(str(tmp_path / "hf"), str(tmp_path / "streamed"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    written = os.path.getsize(tmp_path / "streamed" / "model.safetensors")
    assert written > total > 100 << 20
    print(f"peak {peak / 2**20:.1f} MiB; model {total / 2**20:.1f} MiB; largest tensor {largest / 2**20:.1f} MiB")
    assert peak < 2 * largest + STREAM_BUFFER and peak < total / 8, capsys.readouterr().out
    whole_import(str(tmp_path / "hf"), str(tmp_path / "whole"))
    assert same_bytes(tmp_path / "streamed" / "model.safetensors", tmp_path / "whole" / "model.safetensors")
