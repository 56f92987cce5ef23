"""`moetrain generate`: incremental decoding with a KV cache (moetrain/kv_cache.py, the models' `decode`
methods, moetrain/generate.py) against the full forward, for every family at 4 layers:
the cached logits at every decode position, greedy generation token for token, batches of unequal
prompts, the prompt losses, and the command line (model directory, a checkpoint sharded over
tp / ep ranks, text with the run's tokenizer, ids in and out, errors)."""
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "data", "kjv_tiny", "kjv_tiny.model")
VOCAB = 64


@pytest.fixture(scope="module")
def ms():
    import mindspore

    from moetrain.distributed.topology import cpu_ops_on_calling_thread

    mindspore.set_device("CPU")
    cpu_ops_on_calling_thread()      # as `moetrain generate` does: ~5x faster op-by-op decoding here
    mindspore.set_seed(0)
    return mindspore


def _moe(**over):
    from moetrain.moe.config import MoEConfig

    kw = dict(num_experts=8, top_k=2, ffn_hidden_size=16)
    kw.update(over)
    return MoEConfig(**kw)


def family_config(family, vocab_size=VOCAB):
    """4 layers (configs/moe_tiny.yaml's depth) at a small width; every routing feature of the family."""
    common = dict(vocab_size=vocab_size, hidden_size=32, num_layers=4, num_heads=4, ffn_hidden_size=48,
                  seq_length=24, init_std=0.1)
    if family == "gpt":
        from moetrain.models.gpt import GPTConfig

        return GPTConfig(num_kv_heads=2, **common)
    if family == "moe_gpt":
        from moetrain.models.moe_gpt import MoEGPTConfig

        return MoEGPTConfig(num_kv_heads=2, moe=_moe(), **common)
    if family == "qwen3_moe":
        from moetrain.models.qwen3_moe import Qwen3MoEConfig

        return Qwen3MoEConfig(num_kv_heads=2, head_dim=12, mlp_only_layers=[1], moe=_moe(norm_topk_prob=True),
                              **common)
    from moetrain.models.deepseek_v3 import DeepSeekV3Config

    q_lora = 24 if family == "deepseek_v3" else 0
    moe = _moe(top_k=3, num_shared_experts=1, score_func="sigmoid", num_groups=4, topk_groups=2, group_score_topk=2,
               route_scale=2.5, bias_update_rate=0.01)
    return DeepSeekV3Config(q_lora_rank=q_lora, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                            v_head_dim=6, first_k_dense=1, mtp_depth=1, yarn_factor=4.0,
                            yarn_original_max_positions=6, yarn_mscale=1.0, yarn_mscale_all_dim=1.0,
                            rope_interleave=True, moe=moe, **common)


FAMILIES = ["gpt", "moe_gpt", "qwen3_moe", "deepseek_v3", "deepseek_v3_plain_q"]


def build(ms, family, vocab_size=VOCAB, seed=0):
    """The family's model with a non-zero `expert_bias` in every MoE layer (it must steer the choice)."""
    from moetrain.registry import get_model

    ms.set_seed(seed)
    cfg = family_config(family, vocab_size)
    model = get_model(cfg.name).cls(cfg)
    rng = np.random.default_rng(seed)
    for layer in model.moe_modules() if hasattr(model, "moe_modules") else []:
        layer.expert_bias.set_data(ms.Tensor(rng.normal(0, 0.05, layer.num_experts).astype(np.float32)))
    model.set_train(False)
    return model


@pytest.fixture(scope="module")
def models(ms):
    return {family: build(ms, family) for family in FAMILIES}


def ids_of(shape, seed=0, vocab=VOCAB):
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# the cache against the full forward
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_logits_equal_the_full_forward_at_every_position(ms, models, family):
    """Prefill 5 tokens, then 11 single-token steps (positions 5..15, past YaRN's original 6): every
    position's logits equal `model.logits(ids)` within 1e-5, for a batch of 3 prompts."""
    from moetrain.generate import cached_logits

    model = models[family]
    ids = ids_of((3, 16), seed=1)
    full = model.logits(ms.Tensor(ids)).asnumpy()
    cached = cached_logits(model, ids, prefill=5)
    assert cached.shape == full.shape == (3, 16, VOCAB)
    np.testing.assert_allclose(cached, full, rtol=0, atol=1e-5)
    assert np.abs(full).max() > 0.1          # not trivially small logits


def test_mla_caches_the_normed_latent_and_the_rotary_key_only(ms, models):
    """DeepSeek-V3's cache per layer: the normed kv_lora_rank latent (fp32) and the shared rotary key
    with (interleaved, YaRN) RoPE at each token's absolute position, nothing per head. Layer 0's are
    recomputed from its input, the normed embedding, through the training modules."""
    from moetrain.generate import _ids_tensor

    model = models["deepseek_v3"]
    ids = ids_of((2, 8), seed=3)
    cache = model.new_cache(2)
    model.decode(_ids_tensor(ids[:, :7]), cache)
    model.decode(_ids_tensor(ids[:, 7:]), cache)
    assert len(cache.layers) == 4 and cache.length == 8
    for latent, k_rot in cache.layers:
        assert latent.shape == (2, 8, 16) and k_rot.shape == (2, 8, 4) and latent.dtype == ms.float32
    block = model.layers[0]
    attention = block.attention
    x = block.attention_norm(model.embed(ms.Tensor(ids)))
    latent, k_rot = np.split(attention.wkv_a(x).asnumpy(), [16], -1)
    expected_latent = attention.kv_norm(ms.Tensor(latent)).asnumpy()
    positions = ms.Tensor(np.tile(np.arange(8, dtype=np.int32), (2, 1)))
    expected_k_rot = attention.rope(ms.Tensor(k_rot.reshape(2, 8, 1, 4)), positions).asnumpy().reshape(2, 8, 4)
    np.testing.assert_allclose(cache.layers[0][0].asnumpy(), expected_latent, rtol=0, atol=1e-5)
    np.testing.assert_allclose(cache.layers[0][1].asnumpy(), expected_k_rot, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["moe_gpt", "deepseek_v3"])
def test_greedy_generation_equals_argmax_of_the_full_forward_repeated(ms, models, family):
    """Without a cache: the whole sequence through `model.logits`, argmax of the last column, appended."""
    from moetrain.generate import generate_ids

    model = models[family]
    prompt = ids_of((2, 5), seed=2)
    expected = prompt.copy()
    for _ in range(10):
        last = model.logits(ms.Tensor(expected)).asnumpy()[:, -1]
        expected = np.concatenate([expected, last.argmax(-1)[:, None].astype(np.int32)], axis=1)
    got = generate_ids(model, prompt, 10, temperature=0.0)
    assert got.shape == (2, 15)
    np.testing.assert_array_equal(got, expected)
    assert len(set(got[:, 5:].ravel().tolist())) > 2      # not one token repeated


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_batched_prompts_of_unequal_length_equal_each_alone(ms, models, family):
    """Left-padded rows of 3, 9 and 6 tokens: the same greedy tokens and prompt losses as one by one
    (for Qwen3 also without the cache: the uncached path masks the padding as another document)."""
    from moetrain.generate import generate, prompt_losses

    model = models[family]
    prompts = [ids_of((n,), seed=10 + n).tolist() for n in (3, 9, 6)]
    batched = generate(model, prompts, 7)
    uncached = generate(model, prompts, 7, use_cache=False) if family == "qwen3_moe" else batched
    for prompt, tokens, reference in zip(prompts, batched, uncached):
        (alone,) = generate(model, [prompt], 7)
        np.testing.assert_array_equal(tokens, alone)
        np.testing.assert_array_equal(reference, alone)
    for prompt, losses in zip(prompts, prompt_losses(model, prompts)):
        (alone,) = prompt_losses(model, [prompt])
        np.testing.assert_allclose(losses, alone, rtol=0, atol=1e-5)


def test_prompt_losses_are_the_models_loss(ms, models):
    """`--max-new-tokens 0`: per-token next-token losses whose mean is the model's lm_loss."""
    from moetrain.generate import prompt_losses

    model = models["moe_gpt"]
    ids = ids_of((1, 14), seed=5)
    (losses,) = prompt_losses(model, ids.tolist())
    _, stats = model(ms.Tensor(ids[:, :-1]), ms.Tensor(ids[:, 1:]))
    assert losses.shape == (13,)
    assert float(losses.mean()) == pytest.approx(float(stats["lm_loss"]), abs=1e-5)


def test_eos_stops_a_row_and_pads_it(ms, models):
    from moetrain.generate import generate_ids

    model = models["gpt"]
    prompt = ids_of((2, 4), seed=6)
    free = generate_ids(model, prompt, 6)
    eos = int(free[0, 6])                                  # row 0's third new token ...
    end = 4 + free[0, 4:].tolist().index(eos) + 1          # ... or an earlier one of the same id
    stopped = generate_ids(model, prompt, 6, eos_id=eos)
    np.testing.assert_array_equal(stopped[0, :end], free[0, :end])
    assert (stopped[0, end:] == eos).all()
    if eos not in free[1, 4:].tolist():
        np.testing.assert_array_equal(stopped[1], free[1])


def test_sampling_temperature_top_k_top_p_and_seed():
    from moetrain.generate import sample_next

    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))
    np.testing.assert_array_equal(sample_next(logits, 0.0), [0, 3])
    draws = np.stack([sample_next(logits, 1.0, rng=np.random.default_rng(s)) for s in range(2000)])
    np.testing.assert_allclose((draws[:, 0, None] == np.arange(4)).mean(0), [0.5, 0.3, 0.15, 0.05], atol=0.04)
    top2 = np.stack([sample_next(logits, 1.0, top_k=2, rng=np.random.default_rng(s)) for s in range(500)])
    assert set(top2[:, 0].tolist()) == {0, 1} and set(top2[:, 1].tolist()) == {2, 3}
    nucleus = np.stack([sample_next(logits, 1.0, top_p=0.7, rng=np.random.default_rng(s)) for s in range(500)])
    assert set(nucleus[:, 0].tolist()) == {0, 1}           # 0.5 < 0.7 <= 0.5 + 0.3
    assert set(sample_next(logits, 1.0, top_p=0.4, rng=np.random.default_rng(0)).tolist()) <= {0, 3}
    np.testing.assert_array_equal(sample_next(logits, 0.01, rng=np.random.default_rng(0)), [0, 3])
    a = [sample_next(logits, 1.0, rng=np.random.default_rng(7)) for _ in range(3)]
    np.testing.assert_array_equal(a[0], a[1])


def test_sampled_generation_is_reproducible_with_a_seed(ms, models):
    from moetrain.generate import generate_ids

    model = models["moe_gpt"]
    prompt = ids_of((2, 3), seed=8)
    first = generate_ids(model, prompt, 6, temperature=1.5, top_k=20, top_p=0.95, seed=3)
    np.testing.assert_array_equal(first, generate_ids(model, prompt, 6, temperature=1.5, top_k=20, top_p=0.95,
                                                      seed=3))
    assert not np.array_equal(first, generate_ids(model, prompt, 6, temperature=1.5, seed=4))


def test_prompt_plus_new_tokens_beyond_the_positions_is_refused(ms, models):
    from moetrain.generate import generate_ids

    with pytest.raises(ValueError, match=r"20 tokens; with --max-new-tokens 5 that is 25 positions, but the "
                                         r"model has 24 \(model.seq_length\): use --max-new-tokens 4 or less"):
        generate_ids(models["gpt"], ids_of((1, 20)), 5)


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kjv_model(ms, tmp_path_factory):
    """A moe_gpt model directory over the KJV tokenizer's 2048 pieces, its config naming the tokenizer
    as a training run's does, and the same weights as a checkpoint sharded over tp2 (attention heads)
    and ep2 (experts) in a run folder (no whole model.safetensors)."""
    from moetrain.checkpoint.distributed import FORMAT, LocalTensor, finish_checkpoint, write_rank_pieces
    from moetrain.checkpoint.manager import CheckpointWriter
    from moetrain.checkpoint.model_dir import model_state, save_model_dir
    from moetrain.distributed.sharding import ShardSpec

    root = tmp_path_factory.mktemp("generate")
    model = build(ms, "moe_gpt", vocab_size=2048, seed=1)
    model_section = {"name": "moe_gpt", "vocab_size": 2048, "hidden_size": 32, "num_layers": 4, "num_heads": 4,
                     "num_kv_heads": 2, "ffn_hidden_size": 48, "seq_length": 24, "init_std": 0.05,
                     "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 16}}
    config = {"model": model_section, "data": {"tokenizer": TOKENIZER}}
    state = model_state(model)
    save_model_dir(str(root / "model"), config, state)

    def spec(name, value, rank):
        axis, kind = ((0, "tp") if name.endswith(("wq.weight", "wk.weight", "wv.weight")) else
                      (1, "tp") if name.endswith("wo.weight") else (0, "ep") if ".experts." in name else (None, ""))
        return ShardSpec(value.shape, axis, rank if axis is not None else 0, 2 if axis is not None else 1, kind)

    writer = CheckpointWriter(str(root / "run" / "checkpoints"), 2, suffix="test")
    for rank in range(2):
        items = []
        for name, value in state.items():
            s = spec(name, value, rank)
            if s.axis is not None or rank == 0:
                items.append((LocalTensor(name, "model", s), s.slice_of(value)))
        write_rank_pieces(writer, rank, items, {"model": False, "optimizer": False})
    layout = {"world_size": 2, "dp": 1, "tp": 2, "pp": 1, "ep": 2, "etp": 1, "optimizer_shard": 0}
    finish_checkpoint(writer, 2, {"format": FORMAT, "step": 2, "layout": layout, "trainer_state": {},
                                  "config": config}, str(root / "model" / "config.yaml"))
    return root, model


def cli(argv, capsys):
    from moetrain.cli import main

    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_text_prompt_streams_with_the_runs_tokenizer(kjv_model, capsys):
    from moetrain.data.tokenizer import load_tokenizer
    from moetrain.generate import generate_ids

    root, model = kjv_model
    code, out, err = cli([str(root / "model"), "--prompt", "In the beginning God", "--max-new-tokens", "8",
                          "--temperature", "0", "--eos-id", "-1", "--output", str(root / "text.npy")], capsys)
    assert code == 0, err
    tok = load_tokenizer(TOKENIZER)
    prompt = tok.encode("In the beginning God")
    expected = generate_ids(model, np.array([prompt]), 8)
    np.testing.assert_array_equal(np.load(root / "text.npy"), expected)
    assert out == "In the beginning God" + tok.decode(expected[0].tolist())[len(tok.decode(prompt)):] + "\n"
    assert "8 tokens in" in err


def test_cli_sharded_checkpoint_of_a_run_ids_in_and_out(kjv_model, capsys):
    """The run folder (its latest checkpoint, pieces from two ranks) gives the model directory's ids."""
    root, model = kjv_model
    prompts = ids_of((2, 6), seed=4, vocab=2048)
    np.save(root / "in.npy", prompts)
    code, _, err = cli([str(root / "run"), "--input", str(root / "in.npy"), "--output", str(root / "sharded.npy"),
                        "--max-new-tokens", "5", "--temperature", "0", "--eos-id", "-1"], capsys)
    assert code == 0, err
    assert "step_00000002" in err
    code, _, err = cli([str(root / "model"), "--input", str(root / "in.npy"), "--output", str(root / "dir.npy"),
                        "--max-new-tokens", "5", "--temperature", "0", "--eos-id", "-1"], capsys)
    assert code == 0, err
    sharded, whole = np.load(root / "sharded.npy"), np.load(root / "dir.npy")
    assert sharded.shape == (2, 11) and sharded.dtype == np.int32
    np.testing.assert_array_equal(sharded, whole)
    np.testing.assert_array_equal(sharded[:, :6], prompts)


def test_a_checkpoint_keeps_its_runs_tokenizer_so_text_works_from_any_folder(kjv_model, capsys, tmp_path,
                                                                             monkeypatch):
    """A run names its tokenizer relative to where it trained (`data/kjv_tiny/...` from the repo);
    its checkpoints keep a copy, so `moetrain generate CHECKPOINT --prompt` works from elsewhere."""
    import hashlib

    from moetrain.checkpoint.distributed import FORMAT, LocalTensor, finish_checkpoint, write_rank_pieces
    from moetrain.checkpoint.manager import CheckpointWriter
    from moetrain.checkpoint.model_dir import load_model_dir
    from moetrain.distributed.sharding import ShardSpec
    from moetrain.fileio import read_yaml

    root, _ = kjv_model
    config, state = load_model_dir(str(root / "model"))
    config["data"] = {"tokenizer": os.path.relpath(TOKENIZER, ROOT)}
    (tmp_path / "config.yaml").write_text(__import__("yaml").safe_dump(config))
    monkeypatch.chdir(ROOT)                              # where the run trained
    writer = CheckpointWriter(str(tmp_path / "run" / "checkpoints"), 1, suffix="test")
    write_rank_pieces(writer, 0, [(LocalTensor(n, "model", ShardSpec(v.shape, None, 0, 1, "")), v)
                                  for n, v in state.items()], {"model": False, "optimizer": False})
    layout = {"world_size": 1, "dp": 1, "tp": 1, "pp": 1, "ep": 1, "etp": 1, "optimizer_shard": 0}
    ckpt = finish_checkpoint(writer, 1, {"format": FORMAT, "step": 1, "layout": layout, "trainer_state": {},
                                         "config": config}, str(tmp_path / "config.yaml"))
    digest = lambda path: hashlib.sha256(open(path, "rb").read()).hexdigest()   # noqa: E731
    assert digest(os.path.join(ckpt, "tokenizer.model")) == digest(TOKENIZER)
    assert "tokenizer.model" in read_yaml(os.path.join(ckpt, "manifest.json"))["files"]   # checked on load
    monkeypatch.chdir(tmp_path)                          # elsewhere: the config's relative path finds nothing
    assert not os.path.exists(config["data"]["tokenizer"])
    code, out, err = cli([str(tmp_path / "run"), "--prompt", "In the beginning God", "--max-new-tokens", "3",
                          "--temperature", "0", "--eos-id", "-1"], capsys)
    assert code == 0, err
    assert out.startswith("In the beginning God")


def test_cli_max_new_tokens_0_prints_the_prompts_losses(ms, kjv_model, capsys):
    from moetrain.data.tokenizer import load_tokenizer

    root, model = kjv_model
    text = "And God said, Let there be light"
    code, out, err = cli([str(root / "model"), "--prompt", text, "--max-new-tokens", "0"], capsys)
    assert code == 0, err
    ids = np.array([load_tokenizer(TOKENIZER).encode(text)], np.int32)
    _, stats = model(ms.Tensor(ids[:, :-1]), ms.Tensor(ids[:, 1:]))
    lines = out.splitlines()
    assert lines[0] == f"prompt 1: {ids.shape[1]} tokens"
    per_token = [float(line.split()[2]) for line in lines[2:-1]]
    assert len(per_token) == ids.shape[1] - 1
    mean = float(lines[-1].split()[2])
    assert mean == pytest.approx(float(stats["lm_loss"]), abs=1e-4)
    assert np.mean(per_token) == pytest.approx(float(stats["lm_loss"]), abs=1e-3)


def test_cli_errors_are_one_line_with_exit_code_2(kjv_model, capsys, tmp_path):
    root, _ = kjv_model
    code, out, err = cli([str(root / "model"), "--prompt", "In the beginning God created the heaven and the earth",
                          "--max-new-tokens", "20"], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err == ("moetrain generate: error: the prompt has 12 tokens; with --max-new-tokens 20 that is 32 "
                   "positions, but the model has 24 (model.seq_length): use --max-new-tokens 12 or less, or a "
                   "shorter prompt\n")
    # no tokenizer anywhere: the config names none and the folder holds none
    from moetrain.checkpoint.model_dir import load_model_dir, save_model_dir

    config, state = load_model_dir(str(root / "model"))
    save_model_dir(str(tmp_path / "bare"), {"model": config["model"]}, state)
    code, _, err = cli([str(tmp_path / "bare"), "--prompt", "In the beginning"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "text prompts need a tokenizer" in err and "--tokenizer PATH" in err
    code, out, err = cli([str(tmp_path / "bare"), "--prompt", "In the beginning", "--tokenizer", TOKENIZER,
                          "--max-new-tokens", "3", "--seed", "1"], capsys)
    assert code == 0 and out.startswith("In the beginning"), err
