"""Dense GPT (Llama architecture) against an independent float64 numpy reference.

The reference works on Hugging Face tensor names (`model.layers.{i}.self_attn.q_proj.weight`, ...)
with the Llama / Mixtral math written out naively; test_moe_gpt.py and test_hf_convert.py reuse it.
"""
import numpy as np
import pytest

# ----------------------------------------------------------------------------------------------
# Reference (float64 numpy, HF names, naive loops where it keeps the math obvious)
# ----------------------------------------------------------------------------------------------


def ref_rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def ref_rope(x, theta):
    """HF `apply_rotary_pos_emb` for x `[S, heads, d]` at positions 0..S-1."""
    seq_len, _, dim = x.shape
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    angles = np.arange(seq_len)[:, None] * inv_freq[None, :]
    emb = np.concatenate([angles, angles], axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., dim // 2:], x[..., :dim // 2]], axis=-1)   # rotate_half
    return x * np.cos(emb) + rotated * np.sin(emb)


def ref_attention(x, w, prefix, cfg):
    """Causal GQA for one sequence `x [S, H]`, one head at a time."""
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    seq_len = x.shape[0]
    q = (x @ w[prefix + "q_proj.weight"].T).reshape(seq_len, heads, head_dim)
    k = (x @ w[prefix + "k_proj.weight"].T).reshape(seq_len, kv_heads, head_dim)
    v = (x @ w[prefix + "v_proj.weight"].T).reshape(seq_len, kv_heads, head_dim)
    q, k = ref_rope(q, cfg["rope_theta"]), ref_rope(k, cfg["rope_theta"])
    out = np.zeros((seq_len, heads, head_dim))
    for h in range(heads):
        kv = h // (heads // kv_heads)
        scores = q[:, h] @ k[:, kv].T / np.sqrt(head_dim)
        scores[np.triu_indices(seq_len, k=1)] = -np.inf
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[:, h] = probs @ v[:, kv]
    return out.reshape(seq_len, -1) @ w[prefix + "o_proj.weight"].T


def silu(x):
    return x / (1.0 + np.exp(-x))


def ref_swiglu(x, w_gate, w_up, w_down):
    """`w_*` in HF `[out, in]` layout."""
    return (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def ref_mixtral_moe(x, w, prefix, cfg):
    """Mixtral sparse MoE, per token: softmax router -> top-k -> renormalise -> weighted experts."""
    out = np.zeros_like(x)
    logits = x @ w[prefix + "gate.weight"].T
    for t in range(x.shape[0]):
        probs = np.exp(logits[t] - logits[t].max())
        probs /= probs.sum()
        chosen = np.argsort(-probs, kind="stable")[:cfg["num_experts_per_tok"]]
        weights = probs[chosen] / probs[chosen].sum()
        for e, weight in zip(chosen, weights):
            ep = f"{prefix}experts.{e}."
            out[t] += weight * ref_swiglu(x[t], w[ep + "w1.weight"], w[ep + "w3.weight"], w[ep + "w2.weight"])
    return out


def ref_logits(w, cfg, input_ids):
    """Llama (`mlp.*_proj`) or Mixtral (`block_sparse_moe.*`) logits `[B, S, V]`, float64."""
    w = {k: np.asarray(v, dtype=np.float64) for k, v in w.items()}
    eps = cfg["rms_norm_eps"]
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    batch_logits = []
    for ids in np.asarray(input_ids):
        x = w["model.embed_tokens.weight"][ids]
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = x + ref_attention(ref_rms_norm(x, w[p + "input_layernorm.weight"], eps), w, p + "self_attn.", cfg)
            h = ref_rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
            if p + "block_sparse_moe.gate.weight" in w:
                x = x + ref_mixtral_moe(h, w, p + "block_sparse_moe.", cfg)
            else:
                x = x + ref_swiglu(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"],
                                   w[p + "mlp.down_proj.weight"])
        batch_logits.append(ref_rms_norm(x, w["model.norm.weight"], eps) @ head.T)
    return np.stack(batch_logits)


def ref_cross_entropy(logits, labels):
    logits = logits.reshape(-1, logits.shape[-1]).astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -log_probs[np.arange(len(log_probs)), labels.reshape(-1)].mean()


# Our names -> HF names, written out here independently of moetrain/checkpoint/hf.py.
_LAYER_RENAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}


def to_hf_names(state):
    """moetrain state -> HF Llama/Mixtral (per-expert) tensors, for the reference."""
    out = {}
    for name, value in state.items():
        if name == "embed.weight":
            out["model.embed_tokens.weight"] = value
        elif name == "final_norm.weight":
            out["model.norm.weight"] = value
        elif name == "lm_head.weight":
            out[name] = value
        else:
            _, i, rest = name.split(".", 2)
            p = f"model.layers.{i}."
            if rest in _LAYER_RENAMES:
                out[p + _LAYER_RENAMES[rest]] = value
            elif rest == "moe.router.weight":
                out[p + "block_sparse_moe.gate.weight"] = value
            elif rest.startswith("moe.experts.w_"):
                hf_name = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}[rest.split(".")[2]]
                for e in range(value.shape[0]):   # ours [E, in, out] -> HF [out, in]
                    out[f"{p}block_sparse_moe.experts.{e}.{hf_name}.weight"] = value[e].T
            elif rest == "moe.expert_bias":
                assert not np.any(value), "the Mixtral reference has no expert bias"
            else:
                raise KeyError(f"no HF name for {name}")
    return out


def hf_config_of(cfg):
    """The HF config keys the reference reads, from a GPTConfig / MoEGPTConfig."""
    out = {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
           "hidden_size": cfg.hidden_size, "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta,
           "rms_norm_eps": cfg.norm_eps, "num_hidden_layers": cfg.num_layers,
           "tie_word_embeddings": cfg.tie_embeddings}
    if hasattr(cfg, "moe"):
        out["num_experts_per_tok"] = cfg.moe.top_k
    return out


def randomize(model, seed, scale=0.3):
    """Give every parameter (norm weights included) random O(scale) values so that no part of the
    math is trivially the identity; returns the state. Expert biases stay 0 (Mixtral has none)."""
    from moetrain.checkpoint.model_dir import load_model_state, model_state

    rng = np.random.default_rng(seed)
    state = {}
    for name, value in model_state(model).items():
        if name.endswith("expert_bias"):
            state[name] = np.zeros_like(value)
        elif name.endswith("norm.weight"):
            state[name] = (1.0 + scale * rng.standard_normal(value.shape)).astype(np.float32)
        else:
            state[name] = (scale * rng.standard_normal(value.shape)).astype(np.float32)
    load_model_state(model, state)
    return state


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ms():
    import mindspore

    mindspore.set_device("CPU")
    return mindspore


def tiny_gpt_config(**over):
    from moetrain.models.gpt import GPTConfig

    kw = dict(vocab_size=48, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
              ffn_hidden_size=40, seq_length=16, rope_theta=500.0, norm_eps=1e-5)
    kw.update(over)
    return GPTConfig(**kw)


def build(ms, seed=0, **over):
    from moetrain.models.gpt import GPT

    ms.set_seed(seed)
    cfg = tiny_gpt_config(**over)
    model = GPT(cfg)
    return model, cfg, randomize(model, seed)


def test_config_validation_names_the_key():
    with pytest.raises(ValueError, match=r"model.num_kv_heads: num_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
        tiny_gpt_config(num_kv_heads=3)
    with pytest.raises(ValueError, match=r"model.num_heads: hidden_size \(30\) must be divisible by num_heads"):
        tiny_gpt_config(hidden_size=30)
    with pytest.raises(ValueError, match="model.compute_dtype"):
        tiny_gpt_config(compute_dtype="fp8")
    assert tiny_gpt_config(num_kv_heads=None).num_kv_heads == 4
    assert tiny_gpt_config(hidden_size=30, head_dim=8).head_dim == 8


def test_registered():
    from moetrain.registry import get_model
    from moetrain.models.gpt import GPT, GPTConfig

    entry = get_model("gpt")
    assert entry.cls is GPT and entry.config_cls is GPTConfig


@pytest.mark.parametrize("mode", ["pynative", "jit"])
def test_forward_matches_numpy_reference(ms, mode):
    model, cfg, state = build(ms, seed=1)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11)).astype(np.int32)
    fn = ms.jit(model.logits) if mode == "jit" else model.logits
    logits = fn(ms.Tensor(ids)).asnumpy()
    assert logits.dtype == np.float32 and logits.shape == (2, 11, cfg.vocab_size)
    expected = ref_logits(to_hf_names(state), hf_config_of(cfg), ids)
    assert np.abs(expected).max() > 1.0          # the check is not vacuous
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=2e-5)


def test_explicit_head_dim_and_multi_head(ms):
    model, cfg, state = build(ms, seed=2, hidden_size=24, head_dim=10, num_heads=3, num_kv_heads=3)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 9)).astype(np.int32)
    np.testing.assert_allclose(model.logits(ms.Tensor(ids)).asnumpy(),
                               ref_logits(to_hf_names(state), hf_config_of(cfg), ids), rtol=1e-5, atol=2e-5)


def test_tied_embeddings_share_one_parameter(ms):
    model, cfg, state = build(ms, seed=3, tie_embeddings=True)
    names = [name for name, _ in model.parameters_and_names()]
    assert "lm_head.weight" not in names and names.count("embed.weight") == 1
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 7)).astype(np.int32)
    np.testing.assert_allclose(model.logits(ms.Tensor(ids)).asnumpy(),
                               ref_logits(to_hf_names(state), hf_config_of(cfg), ids), rtol=1e-5, atol=2e-5)
    # The one matrix gets the gradient of both its uses (lookup and head).
    grads = ms.grad(lambda i, l: model(i, l)[0], None, model.trainable_params())(ms.Tensor(ids), ms.Tensor(ids))
    embed_grad = grads[names.index("embed.weight")].asnumpy()
    unused_rows = np.setdiff1d(np.arange(cfg.vocab_size), ids)
    assert np.abs(embed_grad[unused_rows]).max() > 0   # only the head use reaches tokens not in the input


def test_causal_mask(ms):
    model, cfg, _ = build(ms, seed=4)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 10)).astype(np.int32)
    changed = ids.copy()
    changed[0, 6] = (changed[0, 6] + 1) % cfg.vocab_size
    a = model.logits(ms.Tensor(ids)).asnumpy()
    b = model.logits(ms.Tensor(changed)).asnumpy()
    np.testing.assert_allclose(a[:, :6], b[:, :6], rtol=0, atol=1e-6)
    assert np.abs(a[:, 6:] - b[:, 6:]).max(axis=-1).min() > 1e-4   # every later position sees it


def test_loss_equals_numpy_cross_entropy(ms):
    model, cfg, _ = build(ms, seed=5)
    rng = np.random.default_rng(4)
    ids = rng.integers(0, cfg.vocab_size, (3, 8)).astype(np.int32)
    labels = rng.integers(0, cfg.vocab_size, (3, 8)).astype(np.int32)
    loss, stats = model(ms.Tensor(ids), ms.Tensor(labels))
    expected = ref_cross_entropy(model.logits(ms.Tensor(ids)).asnumpy(), labels)
    assert loss.dtype == ms.float32 and loss.shape == ()
    np.testing.assert_allclose(loss.asnumpy(), expected, rtol=1e-6)
    assert set(stats) == {"lm_loss"}
    np.testing.assert_allclose(stats["lm_loss"].asnumpy(), expected, rtol=1e-6)


def test_too_long_input_is_a_clear_error(ms):
    model, cfg, _ = build(ms, seed=6)
    with pytest.raises(ValueError, match="model.seq_length=16"):
        model.logits(ms.Tensor(np.zeros((1, 17), np.int32)))


def test_float16_compute_close_to_float32(ms):
    model, cfg, state = build(ms, seed=7, compute_dtype="float16")
    assert all(p.dtype == ms.float32 for p in model.get_parameters())    # fp32 master weights
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 8)).astype(np.int32)
    logits = model.logits(ms.Tensor(ids)).asnumpy()
    expected = ref_logits(to_hf_names(state), hf_config_of(cfg), ids)
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, expected, rtol=0, atol=2e-2 * np.abs(expected).max())


def test_jit_train_step_decreases_loss_and_matches_pynative(ms):
    from mindspore import nn

    model, cfg, _ = build(ms, seed=8)
    rng = np.random.default_rng(6)
    ids = ms.Tensor(rng.integers(0, cfg.vocab_size, (2, 12)).astype(np.int32))
    labels = ms.Tensor(rng.integers(0, cfg.vocab_size, (2, 12)).astype(np.int32))
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.05)
    grad_fn = ms.value_and_grad(model, None, optimizer.parameters, has_aux=True)
    (eager_loss, _), eager_grads = grad_fn(ids, labels)

    @ms.jit
    def train_step(input_ids, targets):
        (loss, stats), grads = grad_fn(input_ids, targets)
        optimizer(grads)
        return loss, stats, grads

    losses = []
    for step in range(6):
        loss, stats, grads = train_step(ids, labels)
        if step == 0:   # graph mode computes the same loss and gradients as PyNative
            np.testing.assert_allclose(loss.asnumpy(), eager_loss.asnumpy(), rtol=1e-6)
            for g_jit, g_eager in zip(grads, eager_grads):
                np.testing.assert_allclose(g_jit.asnumpy(), g_eager.asnumpy(), rtol=1e-4, atol=1e-6)
        losses.append(float(loss.asnumpy()))
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.8 * losses[0], losses


def test_model_dir_round_trip(ms, tmp_path):
    from moetrain.checkpoint.model_dir import (build_model_from_dict, load_model, load_model_dir,
                                                load_model_state, model_state, save_model_dir)

    model, cfg, state = build(ms, seed=9)
    config_dict = {"model": {k: v for k, v in vars(cfg).items()}, "train": {"seed": 9}}
    save_model_dir(str(tmp_path / "ckpt"), config_dict, model_state(model))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.yaml", "model.safetensors"]
    loaded_config, loaded_state = load_model_dir(str(tmp_path / "ckpt"))
    assert loaded_config == config_dict
    assert set(loaded_state) == set(state)
    for name, value in state.items():
        np.testing.assert_array_equal(loaded_state[name], value)
    reloaded, _ = load_model(str(tmp_path / "ckpt"))
    ids = ms.Tensor(np.arange(8, dtype=np.int32).reshape(1, 8))
    np.testing.assert_array_equal(reloaded.logits(ids).asnumpy(), model.logits(ids).asnumpy())

    fresh = build_model_from_dict(config_dict["model"])
    partial = {k: v for k, v in state.items() if k != "final_norm.weight"}
    partial["extra.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"missing from the checkpoint: \['final_norm.weight'\].*not in the model: \['extra.weight'\]"):
        load_model_state(fresh, partial)
    bad_shape = dict(state, **{"embed.weight": np.zeros((5, 5), np.float32)})
    with pytest.raises(ValueError, match=r"embed.weight: checkpoint \(5, 5\) vs model \(48, 32\)"):
        load_model_state(fresh, bad_shape)
    with pytest.raises(FileNotFoundError, match="config.yaml is missing"):
        load_model_dir(str(tmp_path))


@pytest.mark.parametrize("mode", ["pynative", "jit"])
def test_attention_core_gradients_match_numpy(ms, mode):
    """The hand-written attention backward against the textbook softmax backward in float64."""
    from moetrain.layers import CausalAttentionCore

    rng = np.random.default_rng(7)
    batch, kv_heads, group, seq_len, dim = 2, 2, 3, 5, 4
    q = rng.standard_normal((batch, kv_heads, group * seq_len, dim))
    k, v = rng.standard_normal((2, batch, kv_heads, seq_len, dim))
    upstream = rng.standard_normal((batch, kv_heads, group * seq_len, dim))
    mask = np.where(np.triu(np.ones((seq_len, seq_len)), 1) > 0, -1e9, 0.0)

    scores = np.einsum("bhrd,bhsd->bhrs", q, k) + np.tile(mask, (group, 1))
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = probs @ v
    dprobs = upstream @ v.transpose(0, 1, 3, 2)
    dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True))
    expected = (dscores @ k, dscores.transpose(0, 1, 3, 2) @ q, probs.transpose(0, 1, 3, 2) @ upstream)

    core = CausalAttentionCore()
    f32 = [ms.Tensor(a.astype(np.float32)) for a in (q, k, v, upstream, mask)]

    def loss(q_, k_, v_):
        return (core(q_, k_, v_, f32[4])[0] * f32[3]).sum()

    grad_fn = ms.value_and_grad(loss, (0, 1, 2))
    if mode == "jit":
        grad_fn = ms.jit(grad_fn)
    value, grads = grad_fn(*f32[:3])
    np.testing.assert_allclose(value.asnumpy(), (out * upstream).sum(), rtol=1e-5)
    for got, want, name in zip(grads, expected, ("dq", "dk", "dv")):
        np.testing.assert_allclose(got.asnumpy(), want, rtol=1e-4, atol=1e-5, err_msg=name)
