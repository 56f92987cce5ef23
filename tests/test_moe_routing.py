"""MoE building blocks on hand-made cases: config checks, auxiliary losses, group-limited routing,
the permutation functions and the dispatcher layouts."""
import math

import numpy as np
import pytest


@pytest.fixture(scope="module")
def ms():
    import mindspore

    mindspore.set_device("CPU")   # as the trainer does: a later set_device("CPU") is then a no-op
    return mindspore


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(num_experts=4, top_k=5), "moe.top_k: top_k .5. cannot exceed num_experts .4."),
    (dict(num_experts=6, num_groups=4), "moe.num_groups: num_experts .6. must be divisible by num_groups .4."),
    (dict(num_groups=2, topk_groups=3), "moe.topk_groups: topk_groups .3. cannot exceed num_groups .2."),
    (dict(num_groups=4, topk_groups=3, top_k=2), "moe.topk_groups: .* cannot exceed top_k"),
    (dict(num_experts=8, num_groups=4, topk_groups=1, top_k=3), "moe.top_k: top_k .3. exceeds the 2 experts"),
    (dict(score_func="relu"), "moe.score_func: 'relu' is not one of"),
    (dict(aux_loss_coeff=-0.1), "moe.aux_loss_coeff: must be a number >= 0"),
    (dict(route_scale=0), "moe.route_scale: must be a number > 0"),
    (dict(num_experts=2.5), "moe.num_experts: must be an integer >= 1"),
    (dict(shared_ffn_hidden_size=64), "moe.shared_ffn_hidden_size: .* set num_shared_experts >= 1"),
])
def test_config_rejects_bad_values(kwargs, message):
    from moetrain.moe.config import MoEConfig

    with pytest.raises(ValueError, match=message):
        MoEConfig(**kwargs)


def test_config_shared_hidden_size():
    from moetrain.moe.config import MoEConfig

    assert MoEConfig().shared_hidden_size == 0
    assert MoEConfig(num_shared_experts=2, ffn_hidden_size=96).shared_hidden_size == 192
    assert MoEConfig(num_shared_experts=2, shared_ffn_hidden_size=80).shared_hidden_size == 80


def test_the_removed_dispatcher_key_is_an_unknown_key(tmp_path):
    """`model.moe.dispatcher` was accepted and then raised NotImplementedError; the dispatcher is
    chosen by `parallel.moe_token_dispatcher` now, and the old key is refused at config load."""
    import os

    from moetrain.config import ConfigError, load_config

    cfg = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "moe_tiny.yaml")
    with pytest.raises(ConfigError, match="unknown key 'model.moe.dispatcher'"):
        load_config(cfg, ["model.moe.dispatcher=alltoall"])


# ----------------------------------------------------------------------------------------------
# Auxiliary losses (formulas written out independently of the implementation)
# ----------------------------------------------------------------------------------------------

def test_switch_load_balancing_loss(ms):
    from moetrain.moe.losses import load_balancing_loss, tokens_per_expert

    probs = np.array([[0.7, 0.2, 0.1], [0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.6, 0.1, 0.3]])
    topk_idx = np.array([[0, 1], [0, 1], [1, 2], [0, 2]], np.int32)
    counts = tokens_per_expert(ms.Tensor(topk_idx), 3).asnumpy()
    np.testing.assert_array_equal(counts, [3, 3, 2])
    # Switch: E * sum_i f_i P_i with f_i the fraction of the T*k assignments going to expert i.
    f = np.array([3, 3, 2]) / 8
    p = probs.mean(0)                                   # [0.475, 0.3, 0.225]
    expected = 3 * (f * p).sum()                        # 3 * (0.178125 + 0.1125 + 0.05625) = 1.040625
    loss = load_balancing_loss(ms.Tensor(p, ms.float32), ms.Tensor(counts / 4, ms.float32), 3, 2)
    np.testing.assert_allclose(loss.asnumpy(), expected, rtol=2e-6)
    np.testing.assert_allclose(expected, 1.040625)
    uniform_probs, uniform_fraction = ms.Tensor(np.full(3, 1 / 3), ms.float32), ms.Tensor(np.full(3, 2 / 3), ms.float32)
    uniform = load_balancing_loss(uniform_probs, uniform_fraction, 3, 2)
    np.testing.assert_allclose(uniform.asnumpy(), 1.0, rtol=2e-6)


def test_sequence_load_balancing_loss(ms):
    """DeepSeek-V3 eq. 17-20 per sequence, averaged: sum_i f_i P_i, f_i = E/(k S) count_i."""
    from moetrain.moe.losses import load_balancing_loss, tokens_per_expert

    num_experts, top_k, seq_len = 4, 2, 3
    rng = np.random.default_rng(0)
    scores = rng.random((2, seq_len, num_experts))
    probs = scores / scores.sum(-1, keepdims=True)      # s'_{i,t}: normalised sigmoid scores
    topk_idx = np.array([[[0, 1], [0, 2], [0, 3]], [[1, 2], [1, 2], [3, 1]]], np.int32)
    expected = []
    for b in range(2):
        count = np.zeros(num_experts)
        for choices in topk_idx[b]:
            count[choices] += 1
        f = num_experts / (top_k * seq_len) * count
        expected.append((f * probs[b].mean(0)).sum())
    counts = tokens_per_expert(ms.Tensor(topk_idx), num_experts)
    np.testing.assert_array_equal(counts.asnumpy(), [[3, 1, 1, 1], [0, 3, 2, 1]])
    loss = load_balancing_loss(ms.Tensor(probs.mean(1), ms.float32), counts / seq_len, num_experts, top_k)
    np.testing.assert_allclose(loss.asnumpy(), np.mean(expected), rtol=2e-6)


def test_z_loss(ms):
    from moetrain.moe.losses import z_loss

    logits = np.array([[0.0, 0.0], [1.0, -1.0], [30.0, 29.0]])
    expected = np.mean([np.log(2) ** 2, np.log(np.e + 1 / np.e) ** 2, (30 + np.log(1 + np.exp(-1))) ** 2])
    np.testing.assert_allclose(z_loss(ms.Tensor(logits, ms.float32)).asnumpy(), expected, rtol=2e-6)


def test_seq_aux_loss_needs_sequences(ms):
    from moetrain.moe.config import MoEConfig
    from moetrain.moe.layer import MoELayer

    layer = MoELayer(8, MoEConfig(num_experts=4, ffn_hidden_size=4, seq_aux_loss_coeff=0.1))
    with pytest.raises(ValueError, match=r"pass x as \[batch, seq, hidden\]"):
        layer(ms.Tensor(np.ones((6, 8)), ms.float32))
    assert layer(ms.Tensor(np.ones((2, 3, 8)), ms.float32))[1]["seq_aux_loss"].shape == ()


# ----------------------------------------------------------------------------------------------
# Router
# ----------------------------------------------------------------------------------------------

def identity_router(ms, **moe):
    """A router whose logits are the input itself (H = E), so scores are set by hand."""
    from moetrain.moe.config import MoEConfig
    from moetrain.moe.router import TopKRouter

    cfg = MoEConfig(**moe)
    router = TopKRouter(cfg.num_experts, cfg)
    router.weight.set_data(ms.Tensor(np.eye(cfg.num_experts), ms.float32))
    return router


@pytest.mark.parametrize("jit", [False, True], ids=["pynative", "jit"])
def test_group_limited_routing_picks_from_top_groups_only(ms, jit):
    # 4 groups of 2 experts, keep 2 groups, top-4: a group scores the sum of its best 4 // 2 = 2.
    scores = np.array([0.95, 0.05,    # group 0: sum 1.00 (holds the single best expert)
                       0.60, 0.55,    # group 1: sum 1.15
                       0.90, 0.20,    # group 2: sum 1.10
                       0.10, 0.15])   # group 3: sum 0.25
    logits = np.log(scores / (1 - scores))[None]          # sigmoid(logits) == scores
    router = identity_router(ms, num_experts=8, top_k=4, num_groups=4, topk_groups=2, score_func="sigmoid")
    run = ms.jit(router.construct) if jit else router
    zero_bias = ms.Tensor(np.zeros(8), ms.float32)
    topk_idx, topk_weight, _, _ = (t.asnumpy() for t in run(ms.Tensor(logits, ms.float32), zero_bias))
    np.testing.assert_array_equal(topk_idx[0], [4, 2, 3, 5])       # expert 0 (0.95) is excluded with its group
    np.testing.assert_allclose(topk_weight[0], scores[[4, 2, 3, 5]] / scores[[4, 2, 3, 5]].sum(), rtol=2e-6)
    ungrouped = identity_router(ms, num_experts=8, top_k=4, score_func="sigmoid")
    np.testing.assert_array_equal(ungrouped(ms.Tensor(logits, ms.float32), zero_bias)[0].asnumpy()[0], [0, 4, 2, 3])


def test_router_weights_scale_and_normalisation(ms):
    logits = np.array([[2.0, 1.0, 0.0, -1.0]])
    softmax = np.exp(logits[0]) / np.exp(logits[0]).sum()
    zero_bias = ms.Tensor(np.zeros(4), ms.float32)
    x = ms.Tensor(logits, ms.float32)
    plain = identity_router(ms, num_experts=4, top_k=2, norm_topk_prob=False)
    np.testing.assert_allclose(plain(x, zero_bias)[1].asnumpy()[0], softmax[:2], rtol=2e-6)
    scaled = identity_router(ms, num_experts=4, top_k=2, route_scale=2.5)
    np.testing.assert_allclose(scaled(x, zero_bias)[1].asnumpy()[0], 2.5 * softmax[:2] / softmax[:2].sum(), rtol=2e-6)
    sigmoid = identity_router(ms, num_experts=4, top_k=2, score_func="sigmoid")
    _, _, probs, _ = sigmoid(x, zero_bias)
    s = 1 / (1 + np.exp(-logits[0]))
    np.testing.assert_allclose(probs.asnumpy()[0], s / s.sum(), rtol=1e-6)   # aux-loss probs: normalised


# ----------------------------------------------------------------------------------------------
# Permutation and dispatcher layouts
# ----------------------------------------------------------------------------------------------

def test_sort_by_expert_is_a_stable_sort(ms):
    from moetrain.moe.permutation import assignment_rows, sort_by_expert

    flat_expert = np.array([2, 0, 2, 1, 0, 2, 3, 0], np.int32)
    order, slot_expert, slot_rank, counts = (t.asnumpy() for t in sort_by_expert(ms.Tensor(flat_expert), 5))
    np.testing.assert_array_equal(order, np.argsort(flat_expert, kind="stable"))
    np.testing.assert_array_equal(order, [1, 4, 7, 3, 0, 2, 5, 6])
    np.testing.assert_array_equal(slot_expert, [0, 0, 0, 1, 2, 2, 2, 3])
    np.testing.assert_array_equal(slot_rank, [0, 1, 2, 0, 0, 1, 2, 0])
    np.testing.assert_array_equal(counts, [3, 1, 3, 1, 0])
    slot_row = ms.Tensor(np.arange(8, dtype=np.int32) * 10)
    np.testing.assert_array_equal(assignment_rows(ms.Tensor(order), slot_row).asnumpy()[order], np.arange(8) * 10)


def test_capacity_layout_and_group_of_rows(ms):
    from moetrain.moe.permutation import capacity_layout, group_of_rows

    # ids in [0, 3]: 3 = "not for this buffer"; capacity 2 rows per group
    ids = np.array([2, 0, 3, 2, 0, 2, 0, 1], np.int32)
    order, slot_row = (t.asnumpy() for t in capacity_layout(ms.Tensor(ids), 3, 2))
    row_of = dict(zip(order.tolist(), slot_row.tolist()))
    assert [row_of[c] for c in range(8)] == [4, 0, 6, 5, 1, 6, 6, 2]   # group 0 keeps candidates 1, 4; 6 overflows
    sizes = ms.Tensor(np.array([2, 0, 3], np.int32))
    np.testing.assert_array_equal(group_of_rows(sizes, 7).asnumpy(), [0, 0, 2, 2, 2, 3, 3])


def test_permute_by_id_has_the_token_permute_semantics(ms):
    """sorted[slot[a]] = rows[a // k], rows grouped by ascending id, stable inside an id."""
    from moetrain.moe.permutation import permute_by_id

    rows = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)
    ids = np.array([[2, 0], [1, 2], [0, 3], [2, 1]], np.int32)
    sorted_rows, slot = (t.asnumpy() for t in permute_by_id(ms.Tensor(rows), ms.Tensor(ids), 4))
    np.testing.assert_array_equal(sorted_rows[slot], rows[np.arange(8) // 2])
    np.testing.assert_array_equal(slot, np.argsort(np.argsort(ids.reshape(-1), kind="stable"), kind="stable"))


def test_expert_capacity():
    from moetrain.moe.permutation import expert_capacity

    assert expert_capacity(num_tokens=2048, top_k=2, num_experts=8, capacity_factor=1.25) == 640
    assert expert_capacity(num_tokens=6, top_k=2, num_experts=4, capacity_factor=0.5) == 2
    assert expert_capacity(num_tokens=10, top_k=3, num_experts=4, capacity_factor=1.0) == 8   # ceil(7.5)
    assert expert_capacity(num_tokens=10, top_k=2, num_experts=4, capacity_factor=4.0) == 10  # at most T


@pytest.mark.parametrize("capacity_factor, layout", [(0.0, "rows"), (0.0, "capacity"), (1.0, "capacity")],
                         ids=["dropless-rows", "dropless-capacity", "capacity"])
def test_dispatch_then_combine_is_the_weighted_gather(ms, capacity_factor, layout):
    """With identity experts, combine(dispatch(x)) = sum_j w_tj x_t over kept assignments."""
    from moetrain.moe.dispatcher import SortDispatcher

    num_tokens, hidden, num_experts, top_k = 7, 3, 4, 2
    rng = np.random.default_rng(0)
    x = rng.standard_normal((num_tokens, hidden))
    topk_idx = np.array([[0, 1], [0, 2], [0, 3], [1, 0], [2, 0], [3, 1], [0, 2]], np.int32)
    weight = rng.random((num_tokens, top_k))
    dispatcher = SortDispatcher(num_experts, top_k, capacity_factor, layout)
    expert_input, state = dispatcher.dispatch(ms.Tensor(x, ms.float32), ms.Tensor(topk_idx),
                                              ms.Tensor(weight, ms.float32))
    y = dispatcher.combine(expert_input, state).asnumpy()

    capacity = math.ceil(capacity_factor * num_tokens * top_k / num_experts) if capacity_factor else num_tokens
    kept = np.zeros((num_tokens, top_k))
    seen = np.zeros(num_experts, int)
    for t in range(num_tokens):
        for j in range(top_k):
            seen[topk_idx[t, j]] += 1
            kept[t, j] = seen[topk_idx[t, j]] <= capacity
    np.testing.assert_allclose(y, (weight * kept).sum(1, keepdims=True) * x, rtol=2e-6)
    assert state["dropped"].asnumpy() == (top_k * num_tokens - kept.sum())
    np.testing.assert_array_equal(state["tokens_per_expert"].asnumpy(), [6, 3, 3, 2])
    groups = expert_input.asnumpy()
    if capacity_factor:
        assert groups.shape == (4, 4, 3) and "row_expert" not in state
        np.testing.assert_allclose(groups[0], x[[0, 1, 2, 3]], rtol=1e-6)    # expert 0 keeps its first 4 tokens
        assert float(state["expert_rows"].asnumpy()) == 16
    elif layout == "capacity":   # dropless at the bound: T rows per expert
        assert groups.shape == (4, num_tokens, 3) and float(state["expert_rows"].asnumpy()) == 4 * num_tokens
        np.testing.assert_allclose(groups[1], np.concatenate([x[[0, 3, 5]], np.zeros((4, 3))]), rtol=1e-6)
        assert kept.all()
    else:   # rows sorted by expert, no padding: expert 0 has 6 rows, 1: 3, 2: 3, 3: 2
        assert groups.shape == (14, 3) and float(state["expert_rows"].asnumpy()) == 14
        np.testing.assert_array_equal(state["row_expert"].asnumpy(), [0] * 6 + [1] * 3 + [2] * 3 + [3] * 2)
        np.testing.assert_allclose(groups[6:9], x[[0, 3, 5]], rtol=1e-6)
        assert kept.all()