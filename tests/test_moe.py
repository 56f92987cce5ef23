"""MoELayer against a naive float64 numpy loop over each token's chosen experts.

Gradients of the reference are central finite differences of its loss, so the reference shares
no code or derivation with the layer. Every layer check runs in PyNative and under `ms.jit`.
"""
import numpy as np
import pytest

HIDDEN, FFN = 4, 3
STAT_KEYS = ("aux_loss", "seq_aux_loss", "z_loss", "expert_load", "dropped", "routed")


@pytest.fixture(scope="module")
def ms():
    import mindspore

    mindspore.set_device("CPU")   # as the trainer does: a later set_device("CPU") is then a no-op
    return mindspore


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------

def silu(z):
    return z / (1.0 + np.exp(-z))


def swiglu(x, w_gate, w_up, w_down):
    return (silu(x @ w_gate) * (x @ w_up)) @ w_down


def ref_route(x, p, cfg):
    """Per token: chosen experts (best first), their combine weights, probs for the aux losses."""
    logits = x @ p["router.weight"].T
    if cfg.score_func == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        probs = scores
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
        probs = scores / scores.sum(-1, keepdims=True)
    chosen, weights = [], []
    per_group = cfg.num_experts // cfg.num_groups
    for t in range(x.shape[0]):
        choice = scores[t] + p["expert_bias"]
        if cfg.num_groups > 1:
            groups = choice.reshape(cfg.num_groups, per_group)
            group_score = np.sort(groups, -1)[:, ::-1][:, :cfg.top_k // cfg.topk_groups].sum(-1)
            keep = np.argsort(-group_score)[:cfg.topk_groups]
            choice = np.where(np.isin(np.arange(cfg.num_experts) // per_group, keep), choice, -np.inf)
        experts = np.argsort(-choice)[:cfg.top_k]
        w = scores[t, experts]
        if cfg.norm_topk_prob:
            w = w / w.sum()
        chosen.append(experts)
        weights.append(w * cfg.route_scale)
    return np.array(chosen), np.array(weights), probs, logits


def ref_moe(x, p, cfg, capacity=None):
    """`(y, losses, dropped)` for x `[T, H]` or `[B, S, H]`; a loop over tokens and choices."""
    tokens = x.reshape(-1, x.shape[-1])
    chosen, weights, probs, logits = ref_route(tokens, p, cfg)
    y = np.zeros_like(tokens)
    seen = np.zeros(cfg.num_experts, int)
    dropped = []
    for t in range(tokens.shape[0]):
        for e, w in zip(chosen[t], weights[t]):
            seen[e] += 1
            if capacity is not None and seen[e] > capacity:
                dropped.append((t, e))
                continue
            y[t] += w * swiglu(tokens[t], p["experts.w_gate"][e], p["experts.w_up"][e], p["experts.w_down"][e])
    if cfg.num_shared_experts:
        y += swiglu(tokens, p["shared_experts.w_gate.weight"].T, p["shared_experts.w_up.weight"].T,
                    p["shared_experts.w_down.weight"].T)
    counts = np.zeros((tokens.shape[0], cfg.num_experts))
    for t, experts in enumerate(chosen):
        counts[t, experts] = 1
    scale = cfg.num_experts / cfg.top_k
    losses = {"aux_loss": scale * (probs.mean(0) * counts.sum(0) / len(tokens)).sum(),
              "z_loss": (np.log(np.exp(logits).sum(-1)) ** 2).mean(),
              "seq_aux_loss": 0.0}
    if x.ndim == 3:
        seq_len = x.shape[1]
        seq_probs = probs.reshape(x.shape[0], seq_len, -1).mean(1)
        seq_counts = counts.reshape(x.shape[0], seq_len, -1).sum(1)
        losses["seq_aux_loss"] = np.mean([scale * (seq_probs[b] * seq_counts[b] / seq_len).sum()
                                          for b in range(x.shape[0])])
    return y.reshape(x.shape), losses, counts.sum(0), dropped


def ref_loss(x, p, cfg, cotangent, capacity=None):
    y, losses, _, _ = ref_moe(x, p, cfg, capacity)
    return (y * cotangent).sum() + (cfg.aux_loss_coeff * losses["aux_loss"] + cfg.z_loss_coeff * losses["z_loss"]
                                    + cfg.seq_aux_loss_coeff * losses["seq_aux_loss"])


def numeric_grad(f, array, eps=1e-6):
    grad = np.zeros_like(array)
    for i in np.ndindex(array.shape):
        keep = array[i]
        array[i] = keep + eps
        up = f()
        array[i] = keep - eps
        down = f()
        array[i] = keep
        grad[i] = (up - down) / (2 * eps)
    return grad


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------

def build_layer(ms, seed=0, **moe):
    from moetrain.moe.config import MoEConfig
    from moetrain.moe.layer import MoELayer

    cfg = MoEConfig(**{"num_experts": 4, "top_k": 2, "ffn_hidden_size": FFN, **moe})
    layer = MoELayer(HIDDEN, cfg)
    rng = np.random.default_rng(seed)
    params = {}
    for name, param in layer.parameters_and_names():
        scale = 0.0 if name == "expert_bias" else (1.0 if name == "router.weight" else 0.5)
        params[name] = rng.standard_normal(param.shape) * scale
        param.set_data(ms.Tensor(params[name], ms.float32))
    return layer, cfg, params


def set_param(ms, layer, params, name, value):
    params[name] = np.asarray(value, np.float64)
    dict(layer.parameters_and_names())[name].set_data(ms.Tensor(params[name], ms.float32))


def value_and_grads(ms, layer, x, cotangent, jit):
    """(y, stats, d loss / d x, {param name: grad}) for loss = sum(y * cotangent) + weighted aux."""
    params = layer.trainable_params()
    cotangent_tensor = ms.Tensor(cotangent, ms.float32)

    def loss_fn(x):
        y, stats = layer(x)
        # A dict nested in a tuple of has_aux outputs breaks the jit grad executor (MindSpore 2.10).
        return (y * cotangent_tensor).sum() + layer.weighted_aux(stats), (y, [stats[k] for k in STAT_KEYS])

    grad_fn = ms.value_and_grad(loss_fn, grad_position=0, weights=params, has_aux=True)
    if jit:
        grad_fn = ms.jit(grad_fn)
    (_, (y, stats)), (dx, dparams) = grad_fn(ms.Tensor(x, ms.float32))
    stats = {k: v.asnumpy() for k, v in zip(STAT_KEYS, stats)}
    return y.asnumpy(), stats, dx.asnumpy(), {p.name: g.asnumpy() for p, g in zip(params, dparams)}


def assert_close(actual, expected, rtol=2e-4):
    expected = np.asarray(expected)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * max(1e-3, np.abs(expected).max()))


# ----------------------------------------------------------------------------------------------
# Layer == naive loop
# ----------------------------------------------------------------------------------------------

CASES = {
    # Mixtral: softmax, renormalised top-2, dropless, flattened [T, H] input.
    "dropless": (dict(aux_loss_coeff=0.05), (7, HIDDEN)),
    # Capacity layout with C = T (capacity_factor = E / k): nothing dropped, so identical to dropless;
    # [B, S, H] input with every aux loss on.
    "capacity": (dict(capacity_factor=2.0, aux_loss_coeff=0.05, seq_aux_loss_coeff=0.1, z_loss_coeff=0.02),
                 (2, 3, HIDDEN)),
    # DeepSeek-V3: sigmoid, group-limited, route_scale, shared experts, a non-zero expert bias.
    "deepseek": (dict(num_experts=6, top_k=2, num_groups=3, topk_groups=2, score_func="sigmoid",
                      route_scale=2.5, num_shared_experts=1, shared_ffn_hidden_size=5, bias_update_rate=0.01,
                      aux_loss_coeff=0.0, seq_aux_loss_coeff=0.1), (2, 3, HIDDEN)),
    # Softmax top-1 without renormalisation (Switch), so the router gets gradient from the output.
    "top1": (dict(top_k=1, norm_topk_prob=False, aux_loss_coeff=0.05), (6, HIDDEN)),
}


@pytest.mark.parametrize("jit", [False, True], ids=["pynative", "jit"])
@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_naive_loop(ms, case, jit):
    moe, shape = CASES[case]
    layer, cfg, params = build_layer(ms, seed=len(case), **moe)
    rng = np.random.default_rng(1)
    if case == "deepseek":
        set_param(ms, layer, params, "expert_bias", rng.standard_normal(cfg.num_experts) * 0.3)
    x = rng.standard_normal(shape)
    cotangent = rng.standard_normal(shape)
    y, stats, dx, grads = value_and_grads(ms, layer, x, cotangent, jit)

    y_ref, losses_ref, load_ref, dropped_ref = ref_moe(x, params, cfg)
    assert dropped_ref == [] and stats["dropped"] == 0
    assert_close(y, y_ref)
    np.testing.assert_array_equal(stats["expert_load"], load_ref)
    assert stats["routed"] == x.size // HIDDEN * cfg.top_k
    for key, value in losses_ref.items():
        assert_close(stats[key], value, rtol=1e-5)

    loss = lambda: ref_loss(x, params, cfg, cotangent)  # noqa: E731
    assert_close(dx, numeric_grad(loss, x))
    assert set(grads) == set(params) - {"expert_bias"}
    for name, grad in grads.items():
        assert_close(grad, numeric_grad(loss, params[name]))


# ----------------------------------------------------------------------------------------------
# Dropping, skewed routing, empty experts
# ----------------------------------------------------------------------------------------------

def skew_to_experts_0_and_1(ms, layer, params):
    """A bias so large that every token picks experts 0 and 1 (the weights still come from the scores)."""
    set_param(ms, layer, params, "expert_bias", [100.0, 90.0, 0.0, 0.0])


@pytest.mark.parametrize("jit", [False, True], ids=["pynative", "jit"])
def test_dropless_keeps_everything_and_empty_experts_get_zero_grad(ms, jit):
    layer, cfg, params = build_layer(ms, seed=3)
    skew_to_experts_0_and_1(ms, layer, params)
    rng = np.random.default_rng(2)
    x, cotangent = rng.standard_normal((9, HIDDEN)), rng.standard_normal((9, HIDDEN))
    y, stats, dx, grads = value_and_grads(ms, layer, x, cotangent, jit)

    np.testing.assert_array_equal(stats["expert_load"], [9, 9, 0, 0])
    assert stats["dropped"] == 0
    assert_close(y, ref_moe(x, params, cfg)[0])
    for name in ("experts.w_gate", "experts.w_up", "experts.w_down"):
        assert np.isfinite(grads[name]).all()
        assert (np.abs(grads[name][:2]).max(axis=(1, 2)) > 0).all()
        np.testing.assert_array_equal(grads[name][2:], 0.0)
    assert np.isfinite(dx).all() and np.isfinite(grads["router.weight"]).all()


@pytest.mark.parametrize("jit", [False, True], ids=["pynative", "jit"])
def test_capacity_drops_latest_assignments(ms, jit):
    """E=4, k=2, T=6, capacity_factor=0.5 -> C = ceil(0.5 * 6 * 2 / 4) = 2 rows per expert."""
    layer, cfg, params = build_layer(ms, seed=4, capacity_factor=0.5, aux_loss_coeff=0.0)
    # Identity router on the first 4 features: token t's logits are x[t, :4], so the routing is set by hand.
    set_param(ms, layer, params, "router.weight", np.eye(4, HIDDEN))
    x = np.array([[3.0, 2.0, 0.0, 0.0],    # experts 0, 1
                  [0.0, 3.0, 2.0, 0.0],    # 1, 2
                  [3.0, 0.0, 0.0, 2.0],    # 0, 3
                  [2.0, 3.0, 0.0, 0.0],    # 1 (dropped: 3rd for expert 1), 0 (dropped: 3rd for expert 0)
                  [0.0, 0.0, 3.0, 2.0],    # 2, 3
                  [0.0, 0.0, 2.0, 3.0]])   # 3 (dropped: 3rd for expert 3), 2 (dropped: 3rd for expert 2)
    cotangent = np.random.default_rng(3).standard_normal(x.shape)
    y, stats, dx, grads = value_and_grads(ms, layer, x, cotangent, jit)

    y_ref, _, load_ref, dropped_ref = ref_moe(x, params, cfg, capacity=2)
    assert dropped_ref == [(3, 1), (3, 0), (5, 3), (5, 2)]          # the reference agrees with the hand count
    assert stats["dropped"] == 4 and stats["routed"] == 12
    np.testing.assert_array_equal(stats["expert_load"], [3, 3, 3, 3])   # counted before dropping
    assert_close(y, y_ref)
    np.testing.assert_array_equal(y[[3, 5]], 0.0)                        # both choices of tokens 3 and 5 dropped
    np.testing.assert_array_equal(dx[[3, 5]], 0.0)                       # no aux loss, no path back
    loss = lambda: ref_loss(x, params, cfg, cotangent, capacity=2)  # noqa: E731
    assert_close(grads["experts.w_down"], numeric_grad(loss, params["experts.w_down"]))


def test_capacity_layout_expert_with_no_tokens(ms):
    """The dropless case is covered by the skewed-router test above; here the [E, C, H] layout."""
    layer, _, params = build_layer(ms, seed=5, capacity_factor=1.0)
    set_param(ms, layer, params, "expert_bias", [0.0, 0.0, -100.0, 0.0])   # nobody picks expert 2
    rng = np.random.default_rng(4)
    x, cotangent = rng.standard_normal((5, HIDDEN)), rng.standard_normal((5, HIDDEN))
    y, stats, dx, grads = value_and_grads(ms, layer, x, cotangent, jit=True)
    assert stats["expert_load"][2] == 0
    for value in (y, dx, *grads.values()):
        assert np.isfinite(value).all()
    for name in ("experts.w_gate", "experts.w_up", "experts.w_down"):
        np.testing.assert_array_equal(grads[name][2], 0.0)
        assert np.abs(grads[name][[0, 1, 3]]).max() > 0


# ----------------------------------------------------------------------------------------------
# Expert bias (aux-loss-free balancing)
# ----------------------------------------------------------------------------------------------

def test_expert_bias_changes_routing_not_weights_and_gets_no_gradient(ms):
    layer, cfg, params = build_layer(ms, seed=6)
    x = np.random.default_rng(5).standard_normal((8, HIDDEN))
    tokens = ms.Tensor(x, ms.float32)
    idx_before, weight_before, _, _ = (t.asnumpy() for t in layer.router(tokens, layer.expert_bias))
    set_param(ms, layer, params, "expert_bias", [0.0, 0.0, 0.0, 5.0])
    idx_after, weight_after, _, _ = (t.asnumpy() for t in layer.router(tokens, layer.expert_bias))

    assert (idx_before != idx_after).any() and (idx_after[:, 0] == 3).all()   # routing moved to expert 3
    chosen, weights, _, _ = ref_route(x, params, cfg)
    np.testing.assert_array_equal(idx_after, chosen)
    assert_close(weight_after, weights)                  # weights from the unbiased scores of the chosen experts
    unchanged = [t for t in range(8) if set(idx_before[t]) == set(idx_after[t])]
    assert unchanged                                      # tokens that already had expert 3: same weights
    for t in unchanged:
        before = dict(zip(idx_before[t], weight_before[t]))
        np.testing.assert_array_equal([before[e] for e in idx_after[t]], weight_after[t])
    assert "expert_bias" not in {p.name for p in layer.trainable_params()}

    def loss_fn(x):
        y, stats = layer(x)
        return y.sum() + stats["aux_loss"] + stats["z_loss"]

    bias_grad = ms.grad(loss_fn, grad_position=None, weights=[layer.expert_bias])(tokens)[0]
    np.testing.assert_array_equal(bias_grad.asnumpy(), 0.0)


def test_update_expert_bias_moves_towards_underloaded_experts(ms):
    from moetrain.moe.layer import update_expert_bias

    bias = np.array([0.5, 0.0, -0.5, 0.0], np.float32)
    new = update_expert_bias(bias, load=np.array([10, 2, 4, 0]), rate=0.1)   # mean load 4
    np.testing.assert_allclose(new, [0.4, 0.1, -0.5, 0.1])
    assert new.dtype == np.float32 and bias[0] == 0.5                          # pure: input untouched
    with pytest.raises(ValueError, match="bias and load must both be"):
        update_expert_bias(bias, np.ones(3), 0.1)

    # Repeated updates rebalance a DeepSeek-V3 style (sigmoid) layer whose router favours expert 0.
    layer, _, params = build_layer(ms, seed=7, score_func="sigmoid", bias_update_rate=0.05)
    set_param(ms, layer, params, "router.weight", params["router.weight"] + np.outer([1.5, 0, 0, 0], np.ones(HIDDEN)))
    x = ms.Tensor(np.random.default_rng(6).standard_normal((32, HIDDEN)) + 0.5, ms.float32)
    spread = []
    for _ in range(10):
        load = layer(x)[1]["expert_load"].asnumpy()
        spread.append(load.max() - load.min())
        layer.expert_bias.set_data(ms.Tensor(update_expert_bias(layer.expert_bias.asnumpy(), load, 0.05)))
    assert spread[0] == 20 and max(spread[-3:]) <= 7            # loads 27/15/15/7 -> within 7 of each other
    bias = layer.expert_bias.asnumpy()
    assert bias[0] == bias.min() < 0 < bias[3] == bias.max()    # overloaded expert 0 down, starved expert 3 up


def test_float16_compute_matches_float32(ms):
    layer, _, params = build_layer(ms, seed=8, num_shared_experts=1)
    x = ms.Tensor(np.random.default_rng(7).standard_normal((2, 5, HIDDEN)), ms.float32)
    y32, stats32 = layer(x)

    from moetrain.moe.layer import MoELayer
    half = MoELayer(HIDDEN, layer.cfg, compute_dtype=ms.float16)
    for name, param in half.parameters_and_names():
        param.set_data(ms.Tensor(params[name], ms.float32))
    y16, stats16 = half(x)
    assert y16.dtype == ms.float32                                      # the residual stream keeps its dtype
    np.testing.assert_allclose(y16.asnumpy(), y32.asnumpy(), rtol=0, atol=5e-3 * np.abs(y32.asnumpy()).max())
    np.testing.assert_array_equal(stats16["expert_load"].asnumpy(), stats32["expert_load"].asnumpy())


def test_shared_experts_run_between_dispatch_and_routed_experts_with_the_same_numbers(ms):
    """The shared experts are computed after the dispatch and before the routed experts (PyNative
    runs the graph's order as calls: recorded here), and the output is bitwise the old order's
    (dispatch, experts, combine, then the shared experts)."""
    layer, _, _ = build_layer(ms, seed=3, num_shared_experts=1)
    x = ms.Tensor(np.random.default_rng(4).standard_normal((2, 6, HIDDEN)), ms.float32)
    calls = []
    for name in ("shared_experts", "experts"):
        getattr(layer, name).register_forward_pre_hook(lambda cell, inputs, name=name: calls.append(name))
    dispatcher = layer.dispatcher
    dispatch, combine = dispatcher.dispatch, dispatcher.combine
    dispatcher.dispatch = lambda *a: (calls.append("dispatch"), dispatch(*a))[1]
    dispatcher.combine = lambda *a: (calls.append("combine"), combine(*a))[1]
    y = layer(x)[0].asnumpy()
    assert calls == ["dispatch", "shared_experts", "experts", "combine"]

    tokens = x.reshape(-1, HIDDEN)
    topk_idx, topk_weight, _, _ = layer.router(tokens, layer.expert_bias)
    expert_input, state = dispatch(tokens, topk_idx, topk_weight)
    routed = combine(layer.experts(expert_input, state.get("row_expert"), state.get("group_sizes")), state)
    np.testing.assert_array_equal(y, (routed + layer.shared_experts(tokens)).reshape(x.shape).asnumpy())
