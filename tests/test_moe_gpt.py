"""MoE GPT: layer placement, stats, the full Mixtral forward against the numpy reference,
loss composition, the jit train step and aux-loss-free bias updates."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_gpt import hf_config_of, randomize, ref_cross_entropy, ref_logits, to_hf_names  # noqa: E402


@pytest.fixture(scope="module")
def ms():
    import mindspore

    mindspore.set_device("CPU")
    return mindspore


def tiny_moe_config(moe=None, **over):
    from moetrain.models.moe_gpt import MoEGPTConfig
    from moetrain.moe.config import MoEConfig

    moe_kw = dict(num_experts=4, top_k=2, ffn_hidden_size=16, aux_loss_coeff=0.0, capacity_factor=0.0)
    moe_kw.update(moe or {})
    kw = dict(vocab_size=40, hidden_size=24, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=32,
              seq_length=16, rope_theta=1000.0, moe=MoEConfig(**moe_kw))
    kw.update(over)
    return MoEGPTConfig(**kw)


def build(ms, seed=0, moe=None, **over):
    from moetrain.models.moe_gpt import MoEGPT

    ms.set_seed(seed)
    cfg = tiny_moe_config(moe, **over)
    model = MoEGPT(cfg)
    return model, cfg, randomize(model, seed)


def test_moe_layer_placement():
    assert tiny_moe_config().moe_layers == [0, 1]                                 # Mixtral: all
    assert tiny_moe_config(first_k_dense=1).moe_layers == [1]                     # DeepSeek: dense first
    assert tiny_moe_config(num_layers=7, first_k_dense=1, moe_layer_freq=2).moe_layers == [1, 3, 5]
    assert tiny_moe_config(num_layers=4, moe_layer_freq=3).moe_layers == [0, 3]
    with pytest.raises(ValueError, match=r"model.first_k_dense: must be in \[0, num_layers=2\)"):
        tiny_moe_config(first_k_dense=2)
    with pytest.raises(ValueError, match="model.moe_layer_freq"):
        tiny_moe_config(moe_layer_freq=0)


def test_registered_and_parameter_names(ms):
    from moetrain.registry import get_model
    from moetrain.models.moe_gpt import MoEGPT, MoEGPTConfig

    entry = get_model("moe_gpt")
    assert entry.cls is MoEGPT and entry.config_cls is MoEGPTConfig
    model, _, _ = build(ms, first_k_dense=1)
    names = {name for name, _ in model.parameters_and_names()}
    assert {"layers.0.mlp.w_gate.weight", "layers.0.mlp.w_down.weight"} <= names
    assert not any(n.startswith("layers.0.moe") or n.startswith("layers.1.mlp") for n in names)
    shapes = {name: tuple(p.shape) for name, p in model.parameters_and_names()}
    assert shapes["layers.1.moe.router.weight"] == (4, 24)
    assert shapes["layers.1.moe.experts.w_gate"] == (4, 24, 16)
    assert shapes["layers.1.moe.experts.w_down"] == (4, 16, 24)
    assert shapes["layers.1.moe.expert_bias"] == (4,)


@pytest.mark.parametrize("mode,first_k_dense", [("pynative", 0), ("jit", 0), ("pynative", 1)])
def test_mixtral_forward_matches_numpy_reference(ms, mode, first_k_dense):
    model, cfg, state = build(ms, seed=1, first_k_dense=first_k_dense)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 10)).astype(np.int32)
    fn = ms.jit(model.logits) if mode == "jit" else model.logits
    logits = fn(ms.Tensor(ids)).asnumpy()
    expected = ref_logits(to_hf_names(state), hf_config_of(cfg), ids)
    assert logits.shape == (2, 10, cfg.vocab_size) and np.abs(expected).max() > 1.0
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=2e-5)


def ref_router_stats(w, hf_cfg, ids, num_experts, top_k):
    """Per MoE layer (numpy, float64): expert load, Switch aux loss, sequence aux loss, z-loss."""
    from test_gpt import ref_attention, ref_mixtral_moe, ref_rms_norm

    eps = hf_cfg["rms_norm_eps"]
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    xs = [w["model.embed_tokens.weight"][seq] for seq in ids]
    per_layer = []
    for i in range(hf_cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        probs, counts, z = [], [], []
        for b, x in enumerate(xs):
            x = x + ref_attention(ref_rms_norm(x, w[p + "input_layernorm.weight"], eps), w, p + "self_attn.", hf_cfg)
            h = ref_rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
            logits = h @ w[p + "block_sparse_moe.gate.weight"].T
            pr = np.exp(logits - logits.max(-1, keepdims=True))
            probs.append(pr / pr.sum(-1, keepdims=True))
            count = np.zeros(num_experts)
            for row in logits:
                count[np.argsort(-row)[:top_k]] += 1
            counts.append(count)
            z.append(np.log(np.exp(logits).sum(-1)) ** 2)
            xs[b] = x + ref_mixtral_moe(h, w, p + "block_sparse_moe.", hf_cfg)
        probs, counts = np.stack(probs), np.stack(counts)          # [B, S, E], [B, E]
        seq_len, tokens = probs.shape[1], probs.shape[0] * probs.shape[1]
        scale = num_experts / top_k
        per_layer.append({
            "expert_load": counts.sum(0),
            "aux_loss": scale * (probs.reshape(-1, num_experts).mean(0) * counts.sum(0) / tokens).sum(),
            "seq_aux_loss": scale * (probs.mean(1) * counts / seq_len).sum(-1).mean(),
            "z_loss": np.concatenate(z).mean(),
        })
    return per_layer


def test_stats_and_loss_composition(ms):
    moe = dict(aux_loss_coeff=0.1, seq_aux_loss_coeff=0.05, z_loss_coeff=0.01)
    model, cfg, state = build(ms, seed=2, moe=moe)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, (3, 8)).astype(np.int32)
    labels = rng.integers(0, cfg.vocab_size, (3, 8)).astype(np.int32)
    loss, stats = model(ms.Tensor(ids), ms.Tensor(labels))
    stats = {k: v.asnumpy() for k, v in stats.items()}
    assert set(stats) == {"lm_loss", "aux_loss", "seq_aux_loss", "z_loss", "expert_load", "dropped", "routed",
                          "expert_rows", "dispatch_rows", "dispatch_load"}
    assert stats["expert_load"].shape == (2, 4)
    np.testing.assert_array_equal(stats["dispatch_load"], stats["expert_load"])   # every position counted
    # per MoE layer: dispatched = computed (every routed row, padding excluded), nothing dropped
    np.testing.assert_array_equal(stats["dispatch_rows"][:, :3], [[ids.size * 2, ids.size * 2, 0]] * 2)
    assert stats["dispatch_rows"][:, 3].sum() == stats["expert_rows"]          # the GEMM rows, padding included
    assert stats["routed"] == 2 * ids.size * 2 and stats["dropped"] == 0        # 2 layers, top-2, dropless
    rows_layout = model.moe_modules()[0].experts.layout == "rows"              # capacity layout: E x T rows a layer
    assert stats["expert_rows"] == (stats["routed"] if rows_layout else 2 * 4 * ids.size)
    np.testing.assert_allclose(stats["lm_loss"], ref_cross_entropy(model.logits(ms.Tensor(ids)).asnumpy(), labels),
                               rtol=1e-6)
    reference = ref_router_stats(to_hf_names(state), hf_config_of(cfg), ids, num_experts=4, top_k=2)
    np.testing.assert_array_equal(stats["expert_load"], [layer["expert_load"] for layer in reference])
    for term in ("aux_loss", "seq_aux_loss", "z_loss"):   # unweighted, summed over the MoE layers
        np.testing.assert_allclose(stats[term], sum(layer[term] for layer in reference), rtol=1e-5, err_msg=term)
    # loss = lm_loss + Σ coeff * term
    expected = stats["lm_loss"] + 0.1 * stats["aux_loss"] + 0.05 * stats["seq_aux_loss"] + 0.01 * stats["z_loss"]
    np.testing.assert_allclose(loss.asnumpy(), expected, rtol=1e-6)


def test_jit_train_step_decreases_loss(ms):
    from mindspore import nn

    model, cfg, _ = build(ms, seed=3, moe=dict(aux_loss_coeff=0.01))
    rng = np.random.default_rng(2)
    ids = ms.Tensor(rng.integers(0, cfg.vocab_size, (2, 12)).astype(np.int32))
    labels = ms.Tensor(rng.integers(0, cfg.vocab_size, (2, 12)).astype(np.int32))
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.05)
    assert "layers.0.moe.expert_bias" not in [p.name for p in optimizer.parameters]
    grad_fn = ms.value_and_grad(model, None, optimizer.parameters, has_aux=True)
    (eager_loss, _), _ = grad_fn(ids, labels)

    @ms.jit
    def train_step(input_ids, targets):   # returns tuples: a dict out of jit fails with reused blocks
        (loss, stats), grads = grad_fn(input_ids, targets)
        optimizer(grads)
        return loss, tuple(stats.keys()), tuple(stats.values())

    losses = []
    for _ in range(6):
        loss, keys, values = train_step(ids, labels)
        stats = dict(zip(keys, values))
        losses.append(float(loss.asnumpy()))
    np.testing.assert_allclose(losses[0], eager_loss.asnumpy(), rtol=1e-5)
    assert stats["expert_load"].shape == (2, 4)
    assert losses[-1] < 0.8 * losses[0], losses


def test_update_expert_bias(ms):
    model, cfg, _ = build(ms, seed=4, moe=dict(bias_update_rate=0.01), first_k_dense=1)
    load = np.array([[30.0, 10.0, 10.0, 14.0]])          # one MoE layer; mean 16
    model.update_expert_bias(load)
    np.testing.assert_allclose(model.layers[1].moe.expert_bias.asnumpy(), [-0.01, 0.01, 0.01, 0.01])
    model.update_expert_bias(load)
    np.testing.assert_allclose(model.layers[1].moe.expert_bias.asnumpy(), [-0.02, 0.02, 0.02, 0.02])
    with pytest.raises(ValueError, match=r"expected \(num_moe_layers=1, num_experts=4\)"):
        model.update_expert_bias(np.ones((2, 4)))
    # the bias steers the choice of experts: a large bias on expert 3 routes every token there
    ids = ms.Tensor(np.arange(12, dtype=np.int32).reshape(1, 12))
    model.layers[1].moe.expert_bias.set_data(ms.Tensor(np.array([0, 0, 0, 10.0], np.float32)))
    _, stats = model(ids, ids)
    assert stats["expert_load"].asnumpy()[0, 3] == 12
