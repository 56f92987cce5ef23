"""Write the golden Hugging Face checkpoints under tests/golden/ (run with torch + transformers).

    python -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install torch==2.13.0 transformers safetensors numpy
    /tmp/hfenv/bin/python tools/make_hf_golden.py [--out tests/golden]

Per model (tests/golden/<name>/): config.json and model.safetensors exactly as transformers'
`save_pretrained` writes them (the per-expert names of published checkpoints), plus for DeepSeek-V3
its multi-token-prediction layer at `model.layers.{num_hidden_layers}` in the published names;
`fused_names.json` (name -> shape of every tensor as the transformers model holds it in memory:
the fused expert layout); `input_ids.npy` and `logits.npy` (float32, eager attention); for MTP
`labels.npy` and `mtp_logits.npy` (depth 1, computed by transformers' `MtpModel` loaded from the
checkpoint); for Mixtral, Qwen3-MoE and `deepseek_v3_saved` (a DeepSeek-V3 exactly as
`save_pretrained` writes it: no MTP tensors although config.json keeps `num_nextn_predict_layers: 1`)
`generate_ids.npy`, transformers' greedy `generate` of 32 tokens after 8 prompt tokens. Weights are random with a larger spread than the default init so that the logits
depend visibly on every tensor, and DeepSeek's correction bias is non-zero. `fp8_block/` holds
one FP8 block-quantized weight written by torch (`float8_e4m3fn`) with its `weight_scale_inv` and
the dequantized values torch computes. moetrain's tests read these files without torch.

The variants of what transformers writes (`VARIANTS`; `make_variant`): each saved by
`save_pretrained` (some with a small `max_shard_size`: shards plus `model.safetensors.index.json`),
some with config.json then rewritten as older writers leave it (a legacy `rope_theta` +
`rope_scaling`, or no RoPE key at all); their `logits.npy` are those of the model transformers loads
back from the folder, checked equal to the model that was saved. Folders of a refused feature
(projection biases) keep only config.json.

    /tmp/hfenv/bin/python tools/make_hf_golden.py --only llama_legacy_rope qwen3_moe_sparse_step   # some folders only

`--check-export DIR=NAME ...` loads folders written by `moetrain convert hf-export` (of the import of
golden NAME) with transformers and prints how far their logits are from NAME's `logits.npy`: that
transformers reads what moetrain writes.
"""
from __future__ import annotations

import argparse
import json
import os
import platform

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

SEED = 0
BATCH, SEQ = 2, 12
PROMPT, GENERATE_NEW = 8, 32    # generate_ids.npy: 8 prompt tokens, then 32 greedy ones


def randomize(model: torch.nn.Module, generator: torch.Generator, scale: float = 0.35) -> None:
    """Weights N(0, scale^2); norms 1 + N(0, 0.2^2); DeepSeek's correction bias N(0, 0.1^2)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name and param.ndim == 1:
                param.copy_(1 + 0.2 * noise)
            else:
                param.copy_(scale * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))


def write_generation(out: str, model, tokens: np.ndarray) -> None:
    """generate_ids.npy: `generate(do_sample=False)` of GENERATE_NEW tokens after the first PROMPT
    tokens of each row, with no EOS stop (so every row has the same length), checked against a
    greedy loop of full forwards."""
    prompt = torch.tensor(tokens[:, :PROMPT])
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        ids = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,  # id 0 is no padding
                             max_new_tokens=GENERATE_NEW)
        greedy = prompt
        for _ in range(GENERATE_NEW):
            greedy = torch.cat([greedy, model(greedy).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert ids.shape == (BATCH, PROMPT + GENERATE_NEW) and torch.equal(ids, greedy), "generate != greedy full forwards"
    np.save(os.path.join(out, "generate_ids.npy"), ids.numpy().astype(np.int32))


def write_common(out: str, model, tokens: np.ndarray) -> None:
    """input_ids.npy, logits.npy, fused_names.json of `model` (already saved to `out`)."""
    generation = os.path.join(out, "generation_config.json")   # decoding defaults: not needed here
    if os.path.exists(generation):
        os.remove(generation)
    ids = tokens[:, :SEQ]
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits.float().numpy()
    np.save(os.path.join(out, "input_ids.npy"), ids.astype(np.int32))
    np.save(os.path.join(out, "logits.npy"), logits.astype(np.float32))
    state = {k: list(v.shape) for k, v in model.state_dict().items()}
    with open(os.path.join(out, "fused_names.json"), "w") as fh:
        json.dump(state, fh, indent=0, sort_keys=True)


def build(cls, config, generator):
    config._attn_implementation = "eager"
    model = cls(config).float().eval()
    randomize(model, generator)
    return model


def make_saved(out, generator, tokens, model_cls, config, generate: bool = False) -> None:
    """A random model of `model_cls` saved as transformers saves it, with its golden outputs."""
    model = build(model_cls, config, generator)
    model.save_pretrained(out)
    write_common(out, model, tokens)
    if generate:
        write_generation(out, model, tokens)


LLAMA = dict(vocab_size=64, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
MIXTRAL = dict(vocab_size=64, hidden_size=24, intermediate_size=20, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=6, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
               rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
QWEN3_MOE = dict(vocab_size=64, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=4, num_experts_per_tok=2,
                 norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=32,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def make_variant(out, generator, tokens, model_cls, config, edit=None, shard=None, config_only=False) -> None:
    """`save_pretrained` of a random `model_cls` (in shards of `shard` bytes with an index, if given),
    config.json then edited in place by `edit(dict)`; the golden logits are the reloaded model's."""
    for name in os.listdir(out):      # an earlier run's shards must not linger
        os.remove(os.path.join(out, name))
    model = build(model_cls, config, generator)
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    if config_only:     # a refused feature: the importer must stop at config.json
        for name in os.listdir(out):
            if name != "config.json":
                os.remove(os.path.join(out, name))
        return
    if shard:
        assert os.path.isfile(os.path.join(out, "model.safetensors.index.json")), "not sharded: lower the shard size"
    if edit is not None:
        path = os.path.join(out, "config.json")
        with open(path) as fh:
            saved = json.load(fh)
        edit(saved)
        with open(path, "w") as fh:
            json.dump(saved, fh, indent=2, sort_keys=True)
            fh.write("\n")
    loaded = model_cls.from_pretrained(out, attn_implementation="eager").float().eval()
    ids = torch.tensor(tokens[:, :SEQ])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits), "the folder does not reload as the model saved"
    write_common(out, loaded, tokens)


def legacy_rope(theta=None, scaling=None):
    """config.json as transformers 4 wrote it: top-level `rope_theta` and `rope_scaling`, no `rope_parameters`."""
    def edit(config):
        config.pop("rope_parameters")
        if theta is not None:
            config["rope_theta"] = theta
        config["rope_scaling"] = scaling
    return edit


def no_rope_keys(config):
    """config.json without `rope_parameters` or `rope_theta`: the family's default theta applies."""
    config.pop("rope_parameters")
    config.pop("rope_theta", None)


SHARD = "8KB"     # a few shards of a tiny model
LLAMA_LEGACY = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
MIXTRAL_TIED = dict(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
                    tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
QWEN3_SPARSE = dict(vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=4,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
                    norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[1], max_position_embeddings=32,
                    tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
DEEPSEEK_LEGACY = dict(vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
                       num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                       norm_topk_prob=True, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                       v_head_dim=4, max_position_embeddings=32, num_mtp_layers=0, tie_word_embeddings=False)
YARN = {"factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
        "mscale_all_dim": 0.7}
VARIANTS = {
    # untied head; config.json of transformers 4 (rope_theta 5e5, rope_scaling null); shards + index
    "llama_legacy_rope": lambda o, g, t: make_variant(o, g, t, transformers.LlamaForCausalLM,
                                                      transformers.LlamaConfig(**LLAMA_LEGACY),
                                                      legacy_rope(500000.0, None), SHARD),
    # tied head; no RoPE key at all: Mixtral's default theta (1e6)
    "mixtral_tied_default_rope": lambda o, g, t: make_variant(o, g, t, transformers.MixtralForCausalLM,
                                                              transformers.MixtralConfig(**MIXTRAL_TIED), no_rope_keys),
    # MoE only at layer 3: decoder_sparse_step 2 (layers 1, 3) minus mlp_only_layers [1]; tied; shards + index
    "qwen3_moe_sparse_step": lambda o, g, t: make_variant(o, g, t, transformers.Qwen3MoeForCausalLM,
                                                          transformers.Qwen3MoeConfig(**QWEN3_SPARSE), None, SHARD),
    # YaRN in the published DeepSeek-V3 form: legacy rope_scaling {"type": "yarn", ...}; shards + index
    "deepseek_v3_legacy_yarn": lambda o, g, t: make_variant(
        o, g, t, transformers.DeepseekV3ForCausalLM,
        transformers.DeepseekV3Config(**DEEPSEEK_LEGACY, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **YARN}),
        legacy_rope(10000.0, {"type": "yarn", **YARN}), SHARD),
    # projection biases (refused by hf-import): config.json only
    "llama_bias": lambda o, g, t: make_variant(o, g, t, transformers.LlamaForCausalLM, transformers.LlamaConfig(
        **dict(LLAMA_LEGACY, attention_bias=True, mlp_bias=True)), config_only=True),
    "qwen3_moe_bias": lambda o, g, t: make_variant(o, g, t, transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        **dict(QWEN3_SPARSE, attention_bias=True)), config_only=True),
}


def _published_mtp_tensors(mtp_model, main_model, num_layers: int) -> dict:
    """The MTP model's tensors in the names of published DeepSeek-V3 checkpoints (per-expert)."""
    out = {}
    for k in range(len(mtp_model.layers)):
        prefix = f"model.layers.{num_layers + k}."
        for name, value in mtp_model.layers[k].state_dict().items():
            name = name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
            if name.endswith("mlp.experts.gate_up_proj"):
                ffn = value.shape[1] // 2
                for j in range(value.shape[0]):
                    out[prefix + name.replace("gate_up_proj", f"{j}.gate_proj.weight")] = value[j, :ffn]
                    out[prefix + name.replace("gate_up_proj", f"{j}.up_proj.weight")] = value[j, ffn:]
            elif name.endswith("mlp.experts.down_proj"):
                for j in range(value.shape[0]):
                    out[prefix + name.replace("down_proj", f"{j}.down_proj.weight")] = value[j]
            else:
                out[prefix + name] = value
        out[prefix + "embed_tokens.weight"] = main_model.model.embed_tokens.weight.detach()
        out[prefix + "shared_head.head.weight"] = main_model.lm_head.weight.detach()
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def make_deepseek_v3(out, generator, tokens, variant: str):
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                  num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                  norm_topk_prob=True, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                  max_position_embeddings=32, rms_norm_eps=1e-6)
    if variant in ("mtp", "saved"):      # DeepSeek-V3 proper: low-rank query, MTP depth 1
        cfg = transformers.DeepseekV3Config(**common, q_lora_rank=24, num_mtp_layers=1, tie_word_embeddings=False,
                                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:                     # plain query projection, YaRN (attention factor and softmax mscale != 1), tied head
        cfg = transformers.DeepseekV3Config(**common, q_lora_rank=None, num_mtp_layers=0, tie_word_embeddings=True,
                                            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                             "original_max_position_embeddings": 8, "beta_fast": 32,
                                                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7})
    model = build(transformers.DeepseekV3ForCausalLM, cfg, generator)
    model.save_pretrained(out)
    write_common(out, model, tokens)
    if variant == "saved":    # what save_pretrained writes: no MTP tensors, num_nextn_predict_layers still 1
        write_generation(out, model, tokens)
    if variant != "mtp":
        return
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel(model, 1).float().eval()
    randomize(mtp.layers, generator)
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    tensors.update(_published_mtp_tensors(mtp, model, cfg.num_hidden_layers))
    save_file(tensors, path, metadata={"format": "pt"})
    # Load it back the way transformers does (its MTP weight pattern names layer 61; ours is layer 2).
    transformers.DeepseekV3ForCausalLM._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{cfg.num_hidden_layers}\..*"]
    main = transformers.DeepseekV3ForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    loaded = MtpModel.from_pretrained(main).float().eval()
    for (name, a), b in zip(mtp.layers.state_dict().items(), loaded.layers.state_dict().values()):
        assert torch.equal(a, b), f"MTP tensor {name} did not load back from the published names"
    ids, labels = tokens[:, :SEQ], tokens[:, 1:SEQ + 1]
    captured = {}
    main.model.layers[-1].register_forward_hook(lambda m, i, o: captured.setdefault("h", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        main_logits = main(torch.tensor(ids)).logits.numpy()
        assert np.array_equal(main_logits, np.load(os.path.join(out, "logits.npy")))
        h = captured["h"][:, :SEQ - 1]                       # the last decoder layer's output, before the norm
        positions = torch.arange(1, SEQ).unsqueeze(0)         # the MTP depth-1 tokens sit one position later
        h1 = loaded.forward_layer(0, h, positions, None, input_ids=torch.tensor(labels[:, :SEQ - 1]))
        mtp_logits = loaded._project_to_logits(h1).numpy()
    np.save(os.path.join(out, "labels.npy"), labels.astype(np.int32))
    np.save(os.path.join(out, "mtp_logits.npy"), mtp_logits.astype(np.float32))


def make_fp8_block(out, generator):
    """One [260, 140] weight quantized per 128x128 block (3 x 2 blocks, partial at the edges)."""
    weight = 0.5 * torch.randn(260, 140, generator=generator)
    blocks = torch.zeros(3, 2)
    quantized = torch.zeros(260, 140, dtype=torch.float8_e4m3fn)
    for i in range(3):
        for j in range(2):
            tile = weight[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale = tile.abs().max() / 448.0                       # e4m3 max
            blocks[i, j] = scale
            quantized[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (tile / scale).to(torch.float8_e4m3fn)
    save_file({"proj.weight": quantized, "proj.weight_scale_inv": blocks.float(), "norm.weight": torch.ones(140)},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    expanded = blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)[:260, :140]
    np.save(os.path.join(out, "dequantized.npy"), (quantized.float() * expanded).numpy())
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128]}}, fh, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "golden"))
    ap.add_argument("--only", nargs="+", metavar="NAME", help="write these folders only (the others are kept)")
    ap.add_argument("--check-export", nargs="+", metavar="DIR=NAME",
                    help="load hf-export folders with transformers, compare with golden NAME's logits; write nothing")
    args = ap.parse_args()
    if args.check_export:
        for pair in args.check_export:
            folder, name = pair.split("=")
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()
            ids = np.load(os.path.join(args.out, name, "input_ids.npy")).astype(np.int64)
            with torch.no_grad():
                logits = model(torch.tensor(ids)).logits.numpy()
            gap = float(np.abs(logits - np.load(os.path.join(args.out, name, "logits.npy"))).max())
            print(f"{folder}: {type(model).__name__}, max |logits - {name}/logits.npy| = {gap:.3g}")
        return
    torch.manual_seed(SEED)
    makers = {"llama": lambda o, g, t: make_saved(o, g, t, transformers.LlamaForCausalLM, transformers.LlamaConfig(**LLAMA)),
              "mixtral": lambda o, g, t: make_saved(o, g, t, transformers.MixtralForCausalLM,
                                                    transformers.MixtralConfig(**MIXTRAL), generate=True),
              "qwen3_moe": lambda o, g, t: make_saved(o, g, t, transformers.Qwen3MoeForCausalLM,
                                                      transformers.Qwen3MoeConfig(**QWEN3_MOE), generate=True),
              "deepseek_v3": lambda o, g, t: make_deepseek_v3(o, g, t, "mtp"),
              "deepseek_v3_yarn": lambda o, g, t: make_deepseek_v3(o, g, t, "yarn"),
              "deepseek_v3_saved": lambda o, g, t: make_deepseek_v3(o, g, t, "saved"), **VARIANTS}
    unknown = sorted(set(args.only or ()) - set(makers) - {"fp8_block"})
    if unknown:
        ap.error(f"--only: no golden folder {unknown}; choose from {sorted(makers) + ['fp8_block']}")
    for index, (name, make) in enumerate(makers.items()):     # seeds by position: the same files each time
        if args.only and name not in args.only:
            continue
        generator = torch.Generator().manual_seed(SEED + index)
        tokens = np.random.default_rng(SEED + index).integers(0, 64, (BATCH, SEQ + 1))
        out = os.path.join(args.out, name)
        os.makedirs(out, exist_ok=True)
        make(out, generator, tokens)
        print(f"wrote {out}")
    if args.only:      # VERSIONS.json describes the full set; tests/golden/README.md names later additions
        if "fp8_block" in args.only:
            os.makedirs(os.path.join(args.out, "fp8_block"), exist_ok=True)
            make_fp8_block(os.path.join(args.out, "fp8_block"), torch.Generator().manual_seed(SEED + 100))
        return
    os.makedirs(os.path.join(args.out, "fp8_block"), exist_ok=True)
    make_fp8_block(os.path.join(args.out, "fp8_block"), torch.Generator().manual_seed(SEED + 100))
    with open(os.path.join(args.out, "VERSIONS.json"), "w") as fh:
        json.dump({"torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__,
                   "python": platform.python_version()}, fh, indent=1)


if __name__ == "__main__":
    main()
