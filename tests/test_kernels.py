"""The fused CPU kernels (moetrain/kernels) against numpy (float64), forward and backward, in PyNative
and under ms.jit: grouped GEMM (one weight and the gate|up pair), the linear layer's product, SwiGLU, RMSNorm, LM head + cross-entropy, attention with RoPE, the
router, the MoE token permutation, AdamW and the squared norm; each fused layer against its plain-ops path; the kernels'
thread pool (every task once, concurrent callers, fork, the same bits every call); and the fallback to plain ops when
the kernel library cannot be built."""
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = pytest.mark.parametrize("jit", [False, True], ids=["pynative", "jit"])


@pytest.fixture(scope="module")
def ms():
    import mindspore

    mindspore.set_device("CPU")
    return mindspore


def grad_fn(ms, fn, argnums, jit):
    f = ms.value_and_grad(fn, argnums)
    return ms.jit(f) if jit else f


def layer_loss_and_grads(ms, layer, x, jit):
    """[loss, dx, d(each trainable parameter)] of sum(layer(x)^2) as numpy arrays, taken now (a test
    may swap a layer's kernels for plain ops between two calls)."""
    def loss(x_):
        return (layer(x_) ** 2).sum()

    f = ms.value_and_grad(loss, 0, layer.trainable_params())
    value, (dx, dparams) = (ms.jit(f) if jit else f)(x)
    return [value.asnumpy(), dx.asnumpy()] + [g.asnumpy() for g in dparams]


# ----------------------------------------------------------------------------------------------
# Grouped GEMM, SwiGLU, RMSNorm
# ----------------------------------------------------------------------------------------------


@MODES
@pytest.mark.parametrize("rows, k, f, experts, sorted_rows", [
    (70, 12, 20, 5, 50),
    # f a multiple of 256 and runs of >= 128 rows: the forward copies each expert's matrix with
    # padded rows first (grouped_gemm.cc); the last expert with rows has a run too short for that
    (700, 16, 256, 4, 660),
], ids=["small", "padded-copy"])
def test_grouped_matmul_matches_numpy(ms, kernel_ops, jit, rows, k, f, experts, sorted_rows):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((experts, k, f)).astype(np.float32)
    row_expert = np.sort(rng.integers(0, experts - 1, rows)).astype(np.int32)   # the last expert owns no row
    if experts == 4:
        row_expert = np.repeat(np.arange(3, dtype=np.int32), [400, 200, 100])   # runs of 400, 200, 100 rows
    row_expert[sorted_rows:] = rng.integers(0, experts - 1, rows - sorted_rows)  # an unsorted tail too
    upstream = rng.standard_normal((rows, f)).astype(np.float32)
    op = kernel_ops.GroupedMatmul()

    def loss(x_, w_):
        return (op(x_, w_, ms.Tensor(row_expert)) * ms.Tensor(upstream)).sum()

    value, (dx, dw) = grad_fn(ms, loss, (0, 1), jit)(ms.Tensor(x), ms.Tensor(w))
    x64, w64, up64 = x.astype(np.float64), w.astype(np.float64), upstream.astype(np.float64)
    y_ref = np.stack([x64[n] @ w64[row_expert[n]] for n in range(rows)])
    dx_ref = np.stack([up64[n] @ w64[row_expert[n]].T for n in range(rows)])
    dw_ref = np.zeros_like(w64)
    for n in range(rows):
        dw_ref[row_expert[n]] += np.outer(x64[n], up64[n])
    atol = 1e-5 * max(1.0, max(k, f) / 20)         # float32 sums over up to max(k, f) terms of N(0, 1) products
    np.testing.assert_allclose(op(ms.Tensor(x), ms.Tensor(w), ms.Tensor(row_expert)).asnumpy(), y_ref,
                               rtol=1e-5, atol=atol)
    np.testing.assert_allclose(float(value), (y_ref * up64).sum(), rtol=1e-5)
    np.testing.assert_allclose(dx.asnumpy(), dx_ref, rtol=1e-5, atol=atol)
    np.testing.assert_allclose(dw.asnumpy(), dw_ref, rtol=1e-5, atol=atol)
    assert not dw.asnumpy()[experts - 1].any()


@MODES
@pytest.mark.parametrize("rows, k, fa, fb, experts", [(70, 12, 20, 9, 5), (700, 16, 256, 256, 4)],
                         ids=["small-with-padding", "padded-copy"])
def test_grouped_matmul_pair_matches_numpy(ms, kernel_ops, jit, rows, k, fa, fb, experts):
    """[x @ wa[e] | x @ wb[e]] and the gradients of x, wa and wb (the experts' gate and up weights read
    in place); padding rows (id E) give zero output and gradients, an expert without rows a zero
    weight gradient; 256 columns with runs of at least 128 rows take the padded weight copies."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    wa = rng.standard_normal((experts, k, fa)).astype(np.float32)
    wb = rng.standard_normal((experts, k, fb)).astype(np.float32)
    if experts == 4:
        row_expert = np.repeat(np.arange(4, dtype=np.int32), [400, 200, 60, 40])   # the last 40 rows: padding
        row_expert[row_expert == 3] = experts                                       # experts 3 owns none
    else:
        row_expert = np.sort(rng.integers(0, experts + 1, rows)).astype(np.int32)
        row_expert[row_expert == 2] = 1                                             # expert 2 owns none
        row_expert[:10] = rng.integers(0, 2, 10)                                    # an unsorted head
    upstream = rng.standard_normal((rows, fa + fb)).astype(np.float32)
    op = kernel_ops.GroupedMatmulPair()

    def loss(x_, wa_, wb_):
        return (op(x_, wa_, wb_, ms.Tensor(row_expert)) * ms.Tensor(upstream)).sum()

    _, (dx, dwa, dwb) = grad_fn(ms, loss, (0, 1, 2), jit)(ms.Tensor(x), ms.Tensor(wa), ms.Tensor(wb))
    w64 = np.concatenate([wa, wb], -1).astype(np.float64)
    x64, up64 = x.astype(np.float64), upstream.astype(np.float64)
    real = row_expert < experts
    expert = np.minimum(row_expert, experts - 1)
    y_ref = np.where(real[:, None], np.einsum("nk,nkf->nf", x64, w64[expert]), 0)
    dx_ref = np.where(real[:, None], np.einsum("nf,nkf->nk", up64, w64[expert]), 0)
    dw_ref = np.stack([x64[row_expert == e].T @ up64[row_expert == e] for e in range(experts)])
    atol = 1e-5 * max(1.0, max(k, fa + fb) / 20)
    np.testing.assert_allclose(op(ms.Tensor(x), ms.Tensor(wa), ms.Tensor(wb), ms.Tensor(row_expert)).asnumpy(), y_ref,
                               rtol=1e-5, atol=atol)
    np.testing.assert_allclose(dx.asnumpy(), dx_ref, rtol=1e-5, atol=atol)
    np.testing.assert_allclose(dwa.asnumpy(), dw_ref[..., :fa], rtol=1e-5, atol=atol)
    np.testing.assert_allclose(dwb.asnumpy(), dw_ref[..., fa:], rtol=1e-5, atol=atol)
    assert not dwa.asnumpy()[2 if experts == 5 else 3].any()


def test_grouped_matmul_kernel_skips_padding_rows(ms, kernel_ops):
    """Rows whose expert id is E are padding: zero output, zero input gradient, no weight gradient."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    w = rng.standard_normal((2, 4, 3)).astype(np.float32)
    row_expert = np.array([0, 0, 1, 2, 2, 2], np.int32)        # three padding rows
    upstream = rng.standard_normal((6, 3)).astype(np.float32)
    op = kernel_ops.GroupedMatmul()

    def loss(x_, w_):
        return (op(x_, w_, ms.Tensor(row_expert)) * ms.Tensor(upstream)).sum()

    y = op(ms.Tensor(x), ms.Tensor(w), ms.Tensor(row_expert)).asnumpy()
    _, (dx, dw) = ms.value_and_grad(loss, (0, 1))(ms.Tensor(x), ms.Tensor(w))
    real = row_expert < 2
    want = np.where(real[:, None], np.einsum("nk,nkf->nf", x, w[np.minimum(row_expert, 1)]), 0)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    want_dx = np.where(real[:, None], np.einsum("nf,nkf->nk", upstream, w[np.minimum(row_expert, 1)]), 0)
    np.testing.assert_allclose(dx.asnumpy(), want_dx, rtol=1e-5, atol=1e-6)
    want_dw = np.stack([x[row_expert == e].T @ upstream[row_expert == e] for e in range(2)])
    np.testing.assert_allclose(dw.asnumpy(), want_dw, rtol=1e-5, atol=1e-6)


@MODES
@pytest.mark.parametrize("tokens, top_k, hidden", [(9, 2, 5), (300, 3, 16)], ids=["small", "threads"])
def test_permute_and_unpermute_rows_match_numpy(ms, kernel_ops, jit, tokens, top_k, hidden):
    """PermuteRows: row slot[t k + j] = x[t]; UnpermuteRows: y[t] = sum_j w[t, j] rows[slot[t k + j]];
    both against float64 numpy with their gradients (x; rows and w)."""
    rng = np.random.default_rng(11)
    n = tokens * top_k
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    rows = rng.standard_normal((n, hidden)).astype(np.float32)
    weight = rng.standard_normal((tokens, top_k)).astype(np.float32)
    slot = rng.permutation(n).astype(np.int32)
    up_rows = rng.standard_normal((n, hidden)).astype(np.float32)
    up_tokens = rng.standard_normal((tokens, hidden)).astype(np.float32)
    permute, unpermute = kernel_ops.PermuteRows(), kernel_ops.UnpermuteRows()

    def permute_loss(x_):
        return (permute(x_, ms.Tensor(slot)) * ms.Tensor(up_rows)).sum()

    def unpermute_loss(rows_, weight_):
        return (unpermute(rows_, ms.Tensor(slot), weight_) * ms.Tensor(up_tokens)).sum()

    x64, rows64, w64 = x.astype(np.float64), rows.astype(np.float64), weight.astype(np.float64)
    token_of_row = np.empty(n, np.int64)
    token_of_row[slot] = np.arange(n) // top_k
    picked = rows64[slot].reshape(tokens, top_k, hidden)
    np.testing.assert_array_equal(permute(ms.Tensor(x), ms.Tensor(slot)).asnumpy(), x[token_of_row])
    _, dx = grad_fn(ms, permute_loss, 0, jit)(ms.Tensor(x))
    np.testing.assert_allclose(dx.asnumpy(), up_rows.astype(np.float64)[slot].reshape(tokens, top_k, hidden).sum(1),
                               rtol=1e-6, atol=1e-6)
    y_ref = (w64[:, :, None] * picked).sum(1)
    np.testing.assert_allclose(unpermute(ms.Tensor(rows), ms.Tensor(slot), ms.Tensor(weight)).asnumpy(), y_ref,
                               rtol=1e-5, atol=1e-6)
    value, (drows, dweight) = grad_fn(ms, unpermute_loss, (0, 1), jit)(ms.Tensor(rows), ms.Tensor(weight))
    up64 = up_tokens.astype(np.float64)
    np.testing.assert_allclose(float(value), (y_ref * up64).sum(), rtol=1e-5)
    drows_ref = np.empty_like(rows64)
    drows_ref[slot] = (w64[:, :, None] * up64[:, None, :]).reshape(n, hidden)
    np.testing.assert_allclose(drows.asnumpy(), drows_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dweight.asnumpy(), (picked * up64[:, None, :]).sum(-1), rtol=1e-5, atol=1e-5)


@MODES
def test_moe_layer_permutation_kernels_equal_plain_path(ms, kernel_ops, jit):
    """The dropless MoE layer with the permute / unpermute kernels and with the plain gather +
    batched-matmul path: the same output and the same gradients for the input and every parameter."""
    from moetrain.moe.config import MoEConfig
    from moetrain.moe.layer import MoELayer

    ms.set_seed(3)
    layer = MoELayer(16, MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=8, aux_loss_coeff=0.0))
    moe_ops = layer.dispatcher.ops
    assert moe_ops.rows_kernels is not None and layer.experts.compute == "kernel"
    rng = np.random.default_rng(4)
    x = ms.Tensor(rng.standard_normal((24, 16)).astype(np.float32))
    upstream = ms.Tensor(rng.standard_normal((24, 16)).astype(np.float32))
    params = layer.trainable_params()

    def objective(x_):
        return (layer(x_)[0] * upstream).sum()

    def run():
        f = ms.value_and_grad(objective, 0, params)
        value, (dx, dparams) = (ms.jit(f) if jit else f)(x)
        return [value.asnumpy(), dx.asnumpy()] + [g.asnumpy() for g in dparams]

    fused = run()
    kernels, moe_ops.rows_kernels = moe_ops.rows_kernels, None
    plain = run()
    moe_ops.rows_kernels = kernels
    names = ["value", "dx"] + [p.name for p in params]
    for name, a, b in zip(names, fused, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


@MODES
@pytest.mark.parametrize("rows, k, f", [(3, 5, 4), (700, 24, 40)], ids=["one-block", "partial-blocks"])
def test_linear_matmul_matches_numpy(ms, kernel_ops, jit, rows, k, f):
    """x @ w^T and both gradients; 700 rows and 40 outputs split into row blocks of dx and dw with a
    partial last block (linear.cc)."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((f, k)).astype(np.float32)
    upstream = rng.standard_normal((rows, f)).astype(np.float32)
    op = kernel_ops.LinearMatmul()

    def loss(x_, w_):
        return (op(x_, w_) * ms.Tensor(upstream)).sum()

    _, (dx, dw) = grad_fn(ms, loss, (0, 1), jit)(ms.Tensor(x), ms.Tensor(w))
    x64, w64, up64 = x.astype(np.float64), w.astype(np.float64), upstream.astype(np.float64)
    np.testing.assert_allclose(op(ms.Tensor(x), ms.Tensor(w)).asnumpy(), x64 @ w64.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx.asnumpy(), up64 @ w64, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dw.asnumpy(), up64.T @ x64, rtol=1e-5, atol=1e-4)


@MODES
def test_swiglu_mlp_fused_equals_plain_path(ms, kernel_ops, jit):
    """SwiGLUMLP with the kernels (gate and up as one product over their stacked weights, the fused
    SwiGLU, the linear kernel) equals the plain ops (`ops.MatMul` per projection, `silu * up`): value
    and the gradients of the input and every weight."""
    from mindspore import ops

    from moetrain.layers import SwiGLUMLP

    ms.set_seed(0)
    mlp = SwiGLUMLP(16, 24)
    assert mlp.swiglu is not None
    x = ms.Tensor(np.random.default_rng(6).standard_normal((2, 33, 16)).astype(np.float32))
    params = mlp.trainable_params()
    run = lambda: layer_loss_and_grads(ms, mlp, x, jit)
    fused = run()
    layers = (mlp.w_gate, mlp.w_up, mlp.w_down)
    kernel_products, swiglu = [layer.matmul for layer in layers], mlp.swiglu
    for layer in layers:
        layer.matmul = ops.MatMul(transpose_b=True)
    mlp.swiglu = None
    plain = run()
    for layer, matmul in zip(layers, kernel_products):
        layer.matmul = matmul
    mlp.swiglu = swiglu
    for name, a, b in zip(["loss", "dx"] + [p.name for p in params], fused, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


@MODES
def test_fused_swiglu_matches_numpy(ms, kernel_ops, jit):
    rng = np.random.default_rng(1)
    gate_up = (4 * rng.standard_normal((3, 7, 2 * 9))).astype(np.float32)
    gate_up[0, 0, :2] = [-200.0, 200.0]          # saturated sigmoid stays finite
    upstream = rng.standard_normal((3, 7, 9)).astype(np.float32)
    op = kernel_ops.FusedSwiGLU()

    def loss(gu):
        return (op(gu) * ms.Tensor(upstream)).sum()

    _, grad = grad_fn(ms, loss, 0, jit)(ms.Tensor(gate_up))
    gate, up = gate_up[..., :9].astype(np.float64), gate_up[..., 9:].astype(np.float64)
    sig = 1.0 / (1.0 + np.exp(-gate))
    np.testing.assert_allclose(op(ms.Tensor(gate_up)).asnumpy(), gate * sig * up, rtol=1e-5, atol=1e-5)
    grad_ref = np.concatenate([upstream * up * sig * (1 + gate * (1 - sig)), upstream * gate * sig], -1)
    np.testing.assert_allclose(grad.asnumpy(), grad_ref, rtol=1e-5, atol=1e-4)
    nan_in = gate_up.copy()
    nan_in[1, 2, 3] = np.nan
    assert np.isnan(op(ms.Tensor(nan_in)).asnumpy()[1, 2, 3])   # overflow checks must see NaN


@MODES
def test_fused_rmsnorm_matches_numpy(ms, kernel_ops, jit):
    from moetrain.layers import RMSNorm

    rng = np.random.default_rng(3)
    x = (3 * rng.standard_normal((3, 50, 24))).astype(np.float32)
    weight = rng.standard_normal(24).astype(np.float32)
    upstream = rng.standard_normal((3, 50, 24)).astype(np.float32)
    norm = RMSNorm(24, eps=1e-5)
    assert norm.fused is not None
    norm.weight.set_data(ms.Tensor(weight))

    def loss(x_):
        return (norm(x_) * ms.Tensor(upstream)).sum()

    grad_fn = ms.value_and_grad(loss, 0, norm.trainable_params())
    _, (dx, (dweight,)) = (ms.jit(grad_fn) if jit else grad_fn)(ms.Tensor(x))
    x64 = x.astype(np.float64)
    inv = 1 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5)
    g = upstream * weight
    np.testing.assert_allclose(norm(ms.Tensor(x)).asnumpy(), x64 * inv * weight, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx.asnumpy(), inv * g - x64 * inv ** 3 * (g * x64).mean(-1, keepdims=True),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dweight.asnumpy(), (upstream * x64 * inv).sum((0, 1)), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# LM head + cross-entropy
# ----------------------------------------------------------------------------------------------

def reference_lm_head_loss(h, w, labels):
    """float64: mean CE of h w^T and its gradients for h and w."""
    z = h.astype(np.float64) @ w.astype(np.float64).T
    rows = np.arange(len(labels))
    z_max = z.max(1, keepdims=True)
    probs = np.exp(z - z_max)
    sum_exp = probs.sum(1, keepdims=True)
    probs /= sum_exp
    loss = (np.log(sum_exp[:, 0]) + z_max[:, 0] - z[rows, labels]).mean()
    dz = probs
    dz[rows, labels] -= 1
    dz /= len(labels)
    return loss, dz @ w.astype(np.float64), dz.T @ h.astype(np.float64)


def lm_head_case(rows, hidden, vocab, seed=0):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((rows, hidden)).astype(np.float32)
    w = rng.standard_normal((vocab, hidden)).astype(np.float32)
    labels = rng.integers(0, vocab, rows).astype(np.int32)
    labels[0] = vocab - 1
    labels[-1] = 0
    return h, w, labels


# 1900 rows at V=5003: chunks of 209 rows in gradient groups of 836 (lm_head_loss.cc), so three groups,
# the last of 228 rows ending in a partial chunk, and dw in vocabulary blocks of 640, the last partial;
# 5003 is no multiple of the SIMD width; one row (batch 1, a single token).
LM_HEAD_SHAPES = pytest.mark.parametrize("rows,hidden,vocab", [(1900, 16, 5003), (1, 8, 37), (33, 24, 16)],
                                         ids=["partial-chunks", "one-row", "tiny-vocab"])


@MODES
@LM_HEAD_SHAPES
def test_fused_lm_head_cross_entropy_matches_numpy(ms, kernel_ops, jit, rows, hidden, vocab):
    h, w, labels = lm_head_case(rows, hidden, vocab)
    op = kernel_ops.FusedLMHeadCrossEntropy()
    labels_t = ms.Tensor(labels)

    def loss_fn(h_, w_):
        return op(h_, w_, labels_t) * 3.0     # an upstream gradient other than 1

    loss, (dh, dw) = grad_fn(ms, loss_fn, (0, 1), jit)(ms.Tensor(h), ms.Tensor(w))
    loss_ref, dh_ref, dw_ref = reference_lm_head_loss(h, w, labels)
    assert loss.shape == ()
    np.testing.assert_allclose(float(loss), 3 * loss_ref, rtol=1e-5)
    np.testing.assert_allclose(dh.asnumpy(), 3 * dh_ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dw.asnumpy(), 3 * dw_ref, rtol=1e-4, atol=1e-6)


@MODES
def test_lm_head_logit_stats_compose_a_vocab_parallel_loss(ms, kernel_ops, jit):
    """Two vocabulary slices (as two tp ranks hold them), combined as VocabParallelCrossEntropy
    combines its partials: the loss and the gradients of h and of both weight slices equal numpy."""
    from mindspore import ops

    h, w, labels = lm_head_case(150, 12, 1001, seed=1)
    cut = 500                                            # slices of 500 and 501 rows
    stats = kernel_ops.LMHeadLogitStats()
    labels_t = ms.Tensor(labels)

    def loss_fn(h_, w0, w1):
        parts = [stats(h_, w0, labels_t), stats(h_, w1, labels_t - cut)]
        shift = ops.stop_gradient(ops.maximum(parts[0][0], parts[1][0]))
        sum_exp = sum(s * ops.exp(ops.stop_gradient(m) - shift) for m, s, _ in parts)
        target = sum(t for _, _, t in parts)
        return (ops.log(sum_exp) + shift - target).mean()

    loss, (dh, dw0, dw1) = grad_fn(ms, loss_fn, (0, 1, 2), jit)(ms.Tensor(h), ms.Tensor(w[:cut]), ms.Tensor(w[cut:]))
    loss_ref, dh_ref, dw_ref = reference_lm_head_loss(h, w, labels)
    np.testing.assert_allclose(float(loss), loss_ref, rtol=1e-5)
    np.testing.assert_allclose(dh.asnumpy(), dh_ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.concatenate([dw0.asnumpy(), dw1.asnumpy()]), dw_ref, rtol=1e-4, atol=1e-6)


@MODES
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_gpt_fused_head_loss_equals_plain_path(ms, kernel_ops, jit, tie):
    """The GPT model with the fused LM head + cross-entropy and with the plain head and loss: same
    loss and the same gradient for every parameter (the tied embedding gets both contributions)."""
    from moetrain.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=97, hidden_size=16, num_layers=1, num_heads=2, ffn_hidden_size=24, seq_length=8,
                    tie_embeddings=tie)
    ms.set_seed(0)
    model = GPT(cfg)
    assert model.fused_head_loss is not None
    params = model.trainable_params()
    rng = np.random.default_rng(0)
    ids = ms.Tensor(rng.integers(0, 97, (2, 8)).astype(np.int32))
    labels = ms.Tensor(rng.integers(0, 97, (2, 8)).astype(np.int32))

    def run():
        def loss_fn(ids_, labels_):
            return model(ids_, labels_)[0]

        f = ms.value_and_grad(loss_fn, None, params)
        loss, grads = (ms.jit(f) if jit else f)(ids, labels)
        return [loss.asnumpy()] + [g.asnumpy() for g in grads]

    fused = run()
    kernel, model.fused_head_loss = model.fused_head_loss, None
    plain = run()
    model.fused_head_loss = kernel
    for name, a, b in zip(["loss"] + [p.name for p in params], fused, plain):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=name)


# ----------------------------------------------------------------------------------------------
# Causal attention with RoPE
# ----------------------------------------------------------------------------------------------

def rotation_matrices(seq, dim, theta=10000.0):
    """float64 `[S, D, D]`: RoPE at each position as an explicit matrix (HF rotate_half layout:
    frequency i rotates the pair of dims (i, i + D/2)), built from the angles, not from the tables."""
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    half = dim // 2
    mats = np.zeros((seq, dim, dim))
    for s in range(seq):
        for i in range(half):
            c, sn = np.cos(s * inv_freq[i]), np.sin(s * inv_freq[i])
            mats[s, i, i], mats[s, i, i + half] = c, -sn
            mats[s, i + half, i], mats[s, i + half, i + half] = sn, c
    return mats


def reference_rope_attention(q, k, v, upstream, positions=None, documents=None):
    """float64: output and gradients for q, k, v (pre-RoPE) of sum(upstream * attention), GQA.
    `positions` [B, S]: the position each token is rotated at (None: 0..S-1); `documents` [B, S]: query
    t sees key u only if u <= t and documents[t] == documents[u] (None: causal only)."""
    batch, seq, q_heads, dim = q.shape
    group = q_heads // k.shape[2]
    if positions is None:
        positions = np.broadcast_to(np.arange(seq), (batch, seq))
    rot = rotation_matrices(int(positions.max()) + 1, dim)[positions]          # [B, S, D, D]
    qr = np.einsum("bsij,bshj->bshi", rot, q.astype(np.float64)) / np.sqrt(dim)
    kr = np.repeat(np.einsum("bsij,bshj->bshi", rot, k.astype(np.float64)), group, 2)
    v64 = np.repeat(v.astype(np.float64), group, 2)
    scores = np.einsum("bihd,bjhd->bhij", qr, kr)
    hidden = np.broadcast_to(np.triu(np.ones((seq, seq), bool), 1), (batch, seq, seq))
    if documents is not None:
        hidden = hidden | (documents[:, :, None] != documents[:, None, :])
    scores = np.where(hidden[:, None], -np.inf, scores)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bhij,bjhd->bihd", probs, v64)
    dprobs = np.einsum("bihd,bjhd->bhij", upstream, v64)
    dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True))
    dqr = np.einsum("bhij,bjhd->bihd", dscores, kr)
    fold = (batch, seq, k.shape[2], group, dim)        # sum the gradients of a K/V group's heads
    dkr = np.einsum("bhij,bihd->bjhd", dscores, qr).reshape(fold).sum(3)
    dv = np.einsum("bhij,bihd->bjhd", probs, upstream).reshape(fold).sum(3)
    dq = np.einsum("bsji,bshj->bshi", rot, dqr) / np.sqrt(dim)     # R^T
    dk = np.einsum("bsji,bshj->bshi", rot, dkr)
    return out, dq, dk, dv


@MODES
@pytest.mark.parametrize("batch,seq,q_heads,kv_heads,dim", [(2, 150, 4, 2, 8), (1, 5, 2, 2, 4)],
                         ids=["partial-block-gqa", "batch1-short"])
def test_fused_rope_attention_matches_numpy(ms, kernel_ops, jit, batch, seq, q_heads, kv_heads, dim):
    from moetrain.layers import RotaryEmbedding

    rng = np.random.default_rng(4)            # 150: a partial 64-row block; GQA groups of 2
    q = rng.standard_normal((batch, seq, q_heads, dim)).astype(np.float32)
    k = rng.standard_normal((batch, seq, kv_heads, dim)).astype(np.float32)
    v = rng.standard_normal((batch, seq, kv_heads, dim)).astype(np.float32)
    upstream = rng.standard_normal((batch, seq, q_heads, dim)).astype(np.float32)
    cos, sin = RotaryEmbedding(dim, seq + 7).tables(seq)
    op = kernel_ops.FusedCausalAttention()

    def loss(q_, k_, v_):
        return (op(q_, k_, v_, cos, sin) * ms.Tensor(upstream)).sum()

    _, grads = grad_fn(ms, loss, (0, 1, 2), jit)(ms.Tensor(q), ms.Tensor(k), ms.Tensor(v))
    expected = reference_rope_attention(q, k, v, upstream)
    got = [op(ms.Tensor(q), ms.Tensor(k), ms.Tensor(v), cos, sin).asnumpy()] + [g.asnumpy() for g in grads]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


def reference_block_attention(q, k, v, ranges, r0, tile, query_docs, key_docs, d_out, d_lse):
    """float64 numpy: the tile's query rows `[r0, r0 + tile)` of q `[B, H, G, R, D]` against the union of
    the key `ranges` `((k0, keys, causal, offset), ...)` of k, v `[B, H, K, ·]` (a causal range: row i sees
    range key j only if j <= offset + i; documents: only keys of its own) -> out, lse of the tile and the
    gradients of sum(out * d_out) + sum(lse * d_lse) for q (the tile's rows), k and v."""
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    keys_total, rows = k.shape[2], np.arange(tile)
    seen = np.zeros((q.shape[0], tile, keys_total), bool)
    for k0, keys, causal, offset in ranges:
        j = np.arange(keys)
        ok = (j[None, :] <= offset + rows[:, None]) if causal else np.ones((tile, keys), bool)
        seen[:, :, k0:k0 + keys] |= ok[None]
    if query_docs is not None:
        seen &= query_docs[:, r0:r0 + tile, None] == key_docs[:, None, :]
    mask = seen[:, None, None]                                         # [B, 1, 1, T, K]
    qt = q64[:, :, :, r0:r0 + tile]
    scores = np.where(mask, np.einsum("bhgid,bhjd->bhgij", qt, k64), -np.inf)
    top = scores.max(-1, keepdims=True)
    lse = top + np.log(np.exp(scores - top).sum(-1, keepdims=True))
    probs = np.exp(scores - lse)
    out = np.einsum("bhgij,bhjd->bhgid", probs, v64)
    d_probs = np.einsum("bhgid,bhjd->bhgij", d_out, v64)
    d_scores = probs * (d_probs - (d_out * out).sum(-1, keepdims=True) + d_lse)
    dq = np.einsum("bhgij,bhjd->bhgid", d_scores, k64)
    dk = np.einsum("bhgij,bhgid->bhjd", d_scores, qt)
    dv = np.einsum("bhgij,bhgid->bhjd", probs, d_out)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_block_attention_steps_merge_to_attention_over_their_union(ms, kernel_ops, documents):
    """`BlockAttention`'s kernels (context parallelism's steps, kernels/block_attention.cc) against
    float64 numpy: a tile of query rows `[4, 9)` of 12 against two key ranges, a whole one and a causal
    one at offset 3 (row i sees its keys j <= 3 + i), each a step returning (out, lse), the second merged
    into the first by their log-sum-exp: the output and lse of attention over both ranges; then the
    backward of each step, from the merged out and lse with an lse gradient too, accumulated: dq, and
    dk, dv of each range (none beyond the causal range's last visible key). GQA (2 query heads a K/V
    head), dv != d. With documents a row of the tile sees no key of the first range (its lse -1e30,
    nothing merged from it)."""
    from mindspore import Tensor, ops

    rng = np.random.default_rng(7)
    batch, heads, group, rows, dim, vdim, keys_total, r0, tile = 2, 2, 2, 12, 8, 6, 20, 4, 5
    q = rng.standard_normal((batch, heads, group, rows, dim)).astype(np.float32) * 0.7
    k = rng.standard_normal((batch, heads, keys_total, dim)).astype(np.float32)
    v = rng.standard_normal((batch, heads, keys_total, vdim)).astype(np.float32)
    ranges = ((1, 7, False, 0), (9, 10, True, 3))                       # keys [1, 8) and [9, 19), causal
    query_docs = key_docs = None
    if documents:   # rows 6.. of doc 1 see nothing in [1, 8); in [9, 19) doc 1 starts at key 12
        query_docs = np.array([[0] * 6 + [1] * 6, [0] * 8 + [1] * 4], np.float32)
        key_docs = np.array([[0] * 12 + [1] * 8, [0] * 10 + [1] * 10], np.float32)
    d_out = rng.standard_normal((batch, heads, group, tile, vdim))
    d_lse = rng.standard_normal((batch, heads, group, tile, 1))
    want = reference_block_attention(q, k, v, ranges, r0, tile, query_docs, key_docs, d_out, d_lse)

    op = kernel_ops.BlockAttention()
    placeholder = Tensor(np.zeros((1, 1), np.float32))
    qd = placeholder if query_docs is None else Tensor(query_docs)
    kd = placeholder if key_docs is None else Tensor(key_docs)
    metas = [kernel_ops.block_meta(r0, k0, keys, causal, offset, documents, prior=i > 0)
             for i, (k0, keys, causal, offset) in enumerate(ranges)]
    qt, kt, vt = Tensor(q), Tensor(k), Tensor(v)
    out = ops.zeros((batch, heads, group, tile, vdim), ms.float32)
    lse = ops.zeros((batch, heads, group, tile, 1), ms.float32)
    for meta in metas:
        out, lse = op(qt, kt, vt, qd, kd, out, lse, meta)
    np.testing.assert_allclose(out.asnumpy(), want[0], rtol=1e-5, atol=2e-6, err_msg="out")
    np.testing.assert_allclose(lse.asnumpy(), want[1], rtol=1e-6, atol=1e-6, err_msg="lse")

    def whole_rows(x):   # the tile's rows of a [B, H, G, R, .] tensor, zeros elsewhere
        full = np.zeros((batch, heads, group, rows, x.shape[-1]), np.float32)
        full[:, :, :, r0:r0 + tile] = x
        return Tensor(full)
    merged = [whole_rows(x) for x in (out.asnumpy(), lse.asnumpy(), d_out, d_lse)]
    dq = ops.zeros((batch, heads, group, tile, dim), ms.float32)
    dk_want, dv_want = np.zeros(k.shape), np.zeros(v.shape)
    for meta, (k0, keys, causal, offset) in zip(metas, ranges):
        zeros = [ops.zeros((batch, heads, keys, n), ms.float32) for n in (dim, vdim)]
        dq, dk, dv = op.backward(qt, kt, vt, qd, kd, *merged, dq, *zeros, meta)
        dk_want[:, :, k0:k0 + keys] = want[3][:, :, k0:k0 + keys]
        dv_want[:, :, k0:k0 + keys] = want[4][:, :, k0:k0 + keys]
        if causal:   # keys after the tile's last row: untouched (the accumulators' zeros)
            assert not dk.asnumpy()[:, :, offset + tile:].any() and not dv.asnumpy()[:, :, offset + tile:].any()
        np.testing.assert_allclose(dk.asnumpy(), dk_want[:, :, k0:k0 + keys], rtol=1e-4, atol=2e-5,
                                   err_msg=f"dk [{k0}, {k0 + keys})")
        np.testing.assert_allclose(dv.asnumpy(), dv_want[:, :, k0:k0 + keys], rtol=1e-4, atol=2e-5,
                                   err_msg=f"dv [{k0}, {k0 + keys})")
    np.testing.assert_allclose(dq.asnumpy(), want[2], rtol=1e-4, atol=2e-5, err_msg="dq")


@MODES
def test_attention_layer_fused_equals_plain(ms, kernel_ops, jit):
    """The Attention layer with the fused kernel (RoPE inside) and with the plain ops (RoPE ops,
    transposes, mask): same output and gradients for the input and every projection."""
    from moetrain.layers import Attention, CausalAttentionCore

    ms.set_seed(0)
    layer = Attention(16, 4, 2, 8, max_positions=40)
    assert layer.fused
    x = ms.Tensor(np.random.default_rng(5).standard_normal((2, 33, 16)).astype(np.float32))
    params = layer.trainable_params()
    run = lambda: layer_loss_and_grads(ms, layer, x, jit)
    fused = run()
    core, layer.core, layer.fused = layer.core, CausalAttentionCore(), False
    plain = run()
    layer.core, layer.fused = core, True
    for name, a, b in zip(["loss", "dx"] + [p.name for p in params], fused, plain):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


# data.reset_attention_mask / data.reset_position_ids: which of the two the packed layout carries
LAYOUTS = {"documents+positions": (True, True), "documents": (True, False), "positions": (False, True)}


def packed_layout(lengths_per_row, layout="documents+positions"):
    """(document_ids, position_ids) int32 [B, S] of rows packed with documents of the given lengths, as
    moetrain.data yields them for `layout` (LAYOUTS): ids 0, 1, ... per row, else zeros; positions
    restarting per document, else 0..S-1."""
    mask, restart = LAYOUTS[layout]
    documents = np.array([np.repeat(np.arange(len(lengths)), lengths) for lengths in lengths_per_row], np.int32)
    positions = np.array([np.concatenate([np.arange(n) for n in lengths]) for lengths in lengths_per_row], np.int32)
    if not restart:
        positions = np.broadcast_to(np.arange(documents.shape[1], dtype=np.int32), documents.shape).copy()
    return documents * mask, positions


# rows: documents of one token (first, middle, last), a boundary at position 0 of a row (the row starts
# a new document: ids start at 0, position 0), a row of one document; 150 tokens: the boundaries fall
# inside and across 64-row blocks
DOCUMENT_CASES = {
    "short-docs-and-single-tokens": ([[1, 3, 1, 2, 1], [4, 4], [8]], 2, 2, 4),
    "long-rows-across-blocks": ([[1, 70, 64, 15], [150]], 4, 2, 8),
}


@MODES
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(DOCUMENT_CASES))
def test_fused_attention_with_documents_matches_numpy(ms, kernel_ops, jit, case, layout):
    """The kernel with document ids and per-token positions (packed documents) against float64. (RoPE
    is relative, so restarting positions changes nothing where documents are masked: the positions-only
    layout is the one that tests the per-token rotation.)"""
    from moetrain.layers import RotaryEmbedding

    lengths, q_heads, kv_heads, dim = DOCUMENT_CASES[case]
    documents, positions = packed_layout(lengths, layout)
    batch, seq = documents.shape
    rng = np.random.default_rng(6)
    q = rng.standard_normal((batch, seq, q_heads, dim)).astype(np.float32)
    k = rng.standard_normal((batch, seq, kv_heads, dim)).astype(np.float32)
    v = rng.standard_normal((batch, seq, kv_heads, dim)).astype(np.float32)
    upstream = rng.standard_normal((batch, seq, q_heads, dim)).astype(np.float32)
    cos, sin = RotaryEmbedding(dim, seq + 7).tables(seq + 7)       # more rows than positions used
    op = kernel_ops.FusedCausalAttention()
    pos, doc = ms.Tensor(positions), ms.Tensor(documents)

    def loss(q_, k_, v_):
        return (op(q_, k_, v_, cos, sin, pos, doc) * ms.Tensor(upstream)).sum()

    _, grads = grad_fn(ms, loss, (0, 1, 2), jit)(ms.Tensor(q), ms.Tensor(k), ms.Tensor(v))
    expected = reference_rope_attention(q, k, v, upstream, positions, documents)
    got = [op(ms.Tensor(q), ms.Tensor(k), ms.Tensor(v), cos, sin, pos, doc).asnumpy()] + [g.asnumpy() for g in grads]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)
    # ids that are not a packed run (a document id coming back) are masked key by key
    shuffled = documents[:, ::-1].copy()
    out = op(ms.Tensor(q), ms.Tensor(k), ms.Tensor(v), cos, sin, pos, ms.Tensor(shuffled)).asnumpy()
    np.testing.assert_allclose(out, reference_rope_attention(q, k, v, upstream, positions, shuffled)[0],
                               rtol=1e-4, atol=1e-5)


@MODES
@pytest.mark.parametrize("layout", ["documents+positions", "positions"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_attention_layer_with_documents_matches_numpy(ms, kernel_ops, jit, fused, layout):
    """The Attention layer given packed documents `(document_ids, position_ids)`, through the fused
    kernel and through the plain path (RoPE gathered per token, additive document mask): output and
    input gradient against float64."""
    from moetrain.layers import Attention, CausalAttentionCore

    ms.set_seed(0)
    hidden, heads, kv_heads, dim = 16, 4, 2, 8
    layer = Attention(hidden, heads, kv_heads, dim, max_positions=40)
    if not fused:
        layer.core, layer.fused = CausalAttentionCore(), False
    documents, positions = packed_layout([[1, 6, 1, 4], [12]], layout)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 12, hidden)).astype(np.float32)
    upstream = rng.standard_normal((2, 12, hidden)).astype(np.float32)
    context = (ms.Tensor(documents), ms.Tensor(positions))

    def loss(x_):
        return (layer(x_, context) * ms.Tensor(upstream)).sum()

    f = ms.value_and_grad(loss, 0)
    _, dx = (ms.jit(f) if jit else f)(ms.Tensor(x))
    out = layer(ms.Tensor(x), context).asnumpy()

    w = {name: p.asnumpy().astype(np.float64) for name, p in layer.parameters_and_names()}
    q, k, v = (np.einsum("bsh,oh->bso", x, w[f"{n}.weight"]).reshape(2, 12, -1, dim) for n in ("wq", "wk", "wv"))
    d_attn = np.einsum("bsh,hi->bsi", upstream, w["wo.weight"]).reshape(2, 12, heads, dim)
    attn, dq, dk, dv = reference_rope_attention(q, k, v, d_attn, positions, documents)
    np.testing.assert_allclose(out, np.einsum("bsi,hi->bsh", attn.reshape(2, 12, -1), w["wo.weight"]),
                               rtol=1e-4, atol=1e-5)
    expected_dx = sum(np.einsum("bso,oh->bsh", g.reshape(2, 12, -1), w[f"{n}.weight"])
                      for n, g in (("wq", dq), ("wk", dk), ("wv", dv)))
    np.testing.assert_allclose(dx.asnumpy(), expected_dx, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Router
# ----------------------------------------------------------------------------------------------

def reference_scores(logits, score_func):
    """float64 `(scores, probs)`: softmax scores (also the probs), or sigmoid scores and the probs
    they normalise to."""
    if score_func == "softmax":
        scores = np.exp(logits - logits.max(1, keepdims=True))
        scores /= scores.sum(1, keepdims=True)
        return scores, scores
    scores = 1 / (1 + np.exp(-logits))
    return scores, scores / (scores.sum(1, keepdims=True) + 1e-20)


def reference_routing(logits, bias, top_k, score_func, norm, scale):
    """float64 numpy routing: (topk_idx, topk_weight, probs, tokens_per_expert)."""
    logits = logits.astype(np.float64)
    scores, probs = reference_scores(logits, score_func)
    choice = scores + bias
    idx = np.argsort(-choice, axis=1, kind="stable")[:, :top_k]     # best first, ties to the lower id
    weight = np.take_along_axis(scores, idx, 1)
    if norm:
        weight = weight / (weight.sum(1, keepdims=True) + 1e-20)
    counts = np.bincount(idx.reshape(-1), minlength=logits.shape[1]).astype(np.float64)
    return idx, weight * scale, probs, counts


def numeric_routing_gradient(logits, bias, idx, upstream_w, upstream_p, score_func, norm, scale, eps=1e-6):
    """d/d logits of sum(upstream_w * topk_weight) + sum(upstream_p * probs), central differences in
    float64 with the chosen experts held fixed (the selection is piecewise constant)."""
    def objective(z):
        s, p = reference_scores(z, score_func)
        w = np.take_along_axis(s, idx, 1)
        if norm:
            w = w / (w.sum(1, keepdims=True) + 1e-20)
        return (upstream_w * w * scale).sum() + (upstream_p * p).sum()

    z = logits.astype(np.float64)
    grad = np.zeros_like(z)
    for index in np.ndindex(*z.shape):
        plus, minus = z.copy(), z.copy()
        plus[index] += eps
        minus[index] -= eps
        grad[index] = (objective(plus) - objective(minus)) / (2 * eps)
    return grad


ROUTER_CASES = pytest.mark.parametrize("score_func,norm,scale,experts,top_k", [
    ("softmax", True, 1.0, 8, 2), ("softmax", False, 1.0, 5, 3), ("sigmoid", True, 2.5, 7, 2),
    ("sigmoid", False, 1.0, 16, 1)], ids=["mixtral", "softmax-unnormed-k3", "deepseek-scaled", "sigmoid-k1"])


@MODES
@ROUTER_CASES
def test_fused_router_matches_numpy(ms, kernel_ops, jit, score_func, norm, scale, experts, top_k):
    rng = np.random.default_rng(6)
    tokens = 37
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    bias = (0.3 * rng.standard_normal(experts)).astype(np.float32)     # steers the choice only
    logits[4, :] = -3.0
    logits[4, experts - 1] = 5.0          # row 4 scores expert E-1 best, but its bias keeps it out:
    bias[experts - 1] = -10.0             # the bias steers the choice only; expert E-1 gets no rows
    upstream_w = rng.standard_normal((tokens, top_k)).astype(np.float32)
    upstream_p = rng.standard_normal((tokens, experts)).astype(np.float32)
    op = kernel_ops.FusedRouter(top_k, score_func, norm, scale)
    bias_t = ms.Tensor(bias)

    def objective(z):
        _, weight, probs, _ = op(z, bias_t)
        return (weight * ms.Tensor(upstream_w)).sum() + (probs * ms.Tensor(upstream_p)).sum()

    _, d_logits = grad_fn(ms, objective, 0, jit)(ms.Tensor(logits))
    idx, weight, probs, counts = (t.asnumpy() for t in op(ms.Tensor(logits), bias_t))
    idx_ref, weight_ref, probs_ref, counts_ref = reference_routing(logits, bias, top_k, score_func, norm, scale)
    assert idx.dtype == np.int32
    np.testing.assert_array_equal(idx, idx_ref)
    np.testing.assert_allclose(weight, weight_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(probs, probs_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(counts, counts_ref)
    assert counts[experts - 1] == 0
    grad_ref = numeric_routing_gradient(logits, bias, idx_ref, upstream_w, upstream_p, score_func, norm, scale)
    np.testing.assert_allclose(d_logits.asnumpy(), grad_ref, rtol=1e-4, atol=1e-6)


def test_fused_router_one_token_and_nan_stays_in_range(ms, kernel_ops):
    op = kernel_ops.FusedRouter(2, "softmax", True, 1.0)
    idx, weight, _, counts = (t.asnumpy() for t in op(ms.Tensor(np.array([[0.1, 2.0, -1.0]], np.float32)),
                                                      ms.Tensor(np.zeros(3, np.float32))))
    np.testing.assert_array_equal(idx, [[1, 0]])
    np.testing.assert_array_equal(counts, [1, 1, 0])
    ties = ms.Tensor(np.ones((1, 3), np.float32))
    np.testing.assert_array_equal(op(ties, ms.Tensor(np.zeros(3, np.float32)))[0].asnumpy(), [[0, 1]])
    nan = np.full((2, 4), np.nan, np.float32)
    idx, weight, _, _ = (t.asnumpy() for t in op(ms.Tensor(nan), ms.Tensor(np.zeros(4, np.float32))))
    assert ((idx >= 0) & (idx < 4)).all() and (idx[:, 0] != idx[:, 1]).all()   # valid ids for the dispatcher
    assert np.isnan(weight).all()                                              # the overflow check sees NaN


@MODES
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_fused_equals_plain(ms, kernel_ops, jit, score_func):
    """TopKRouter with the fused kernel and with the plain ops: same routing, weights, probs, logits
    and the same gradients for the input and the router weight."""
    from moetrain.moe.config import MoEConfig
    from moetrain.moe.router import TopKRouter

    cfg = MoEConfig(num_experts=6, top_k=2, ffn_hidden_size=8, score_func=score_func, route_scale=1.5)
    ms.set_seed(1)
    router = TopKRouter(12, cfg)
    assert router.fused is not None
    rng = np.random.default_rng(7)
    x = ms.Tensor(rng.standard_normal((40, 12)).astype(np.float32))
    bias = ms.Tensor((0.1 * rng.standard_normal(6)).astype(np.float32))
    up_w, up_p = ms.Tensor(rng.standard_normal((40, 2)).astype(np.float32)), ms.Tensor(rng.standard_normal((40, 6)).astype(np.float32))

    def objective(x_):
        idx, weight, probs, logits = router(x_, bias)
        return (weight * up_w).sum() + (probs * up_p).sum() + (logits ** 2).sum() * 0.1, idx

    def run():
        f = ms.value_and_grad(objective, 0, router.trainable_params(), has_aux=True)
        (value, idx), (dx, (dweight,)) = (ms.jit(f) if jit else f)(x)
        return [value.asnumpy(), idx.asnumpy(), dx.asnumpy(), dweight.asnumpy()]

    fused = run()
    kernel, router.fused = router.fused, None
    plain = run()
    router.fused = kernel
    for name, a, b in zip(("value", "idx", "dx", "dweight"), fused, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


# ----------------------------------------------------------------------------------------------
# AdamW over flat buffers, in place
# ----------------------------------------------------------------------------------------------

def reference_adam_step(p, m, v, g, lr, step, grad_scale, wd, beta1, beta2, eps, decoupled):
    """float64, torch.optim.AdamW (decoupled) / Adam (L2 in the gradient) arithmetic; wd per element."""
    g = g * grad_scale
    if not decoupled:
        g = g + wd * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    if decoupled:
        p = p * (1 - lr * wd)
    denom = np.sqrt(v) / np.sqrt(1 - beta2 ** step) + eps
    return p - lr / (1 - beta1 ** step) * m / denom, m, v


@MODES
@pytest.mark.parametrize("sizes", [(70001,), (25000, 1, 45000)], ids=["one-buffer", "three-tensors"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam-l2"])
def test_fused_adamw_updates_in_place_like_torch(ms, kernel_ops, jit, decoupled, sizes):
    from mindspore import Parameter

    rng = np.random.default_rng(8)
    n = sum(sizes)                                             # 70001: not a multiple of the SIMD width
    ends = np.array([30000, 30000, 50000, n], np.int64)        # an empty segment too; segments cross tensors
    decay = np.array([0.1, 0.5, 0.0, 0.02], np.float32)
    wd = np.repeat(decay, np.diff(np.concatenate([[0], ends])))
    p0 = rng.standard_normal(n).astype(np.float32)
    cuts = np.cumsum((0,) + sizes)
    shapes = [(size,) if i % 2 else (1, size) for i, size in enumerate(sizes)]   # any shape: the elements count
    params = tuple(Parameter(ms.Tensor(p0[a:b].reshape(shape)), name=f"p{i}")
                   for i, (a, b, shape) in enumerate(zip(cuts, cuts[1:], shapes)))
    exp_avgs = tuple(Parameter(ms.Tensor(np.zeros(shape, np.float32)), name=f"m{i}") for i, shape in enumerate(shapes))
    exp_avg_sqs = tuple(Parameter(ms.Tensor(np.zeros(shape, np.float32)), name=f"v{i}")
                        for i, shape in enumerate(shapes))
    op = kernel_ops.FusedAdamW(0.9, 0.95, 1e-8, decoupled, tensors=len(sizes))
    concat = lambda tensors: np.concatenate([t.asnumpy().reshape(-1) for t in tensors])

    def update(grad, lr, step, scale):
        before = params[-1] * 1.0
        op(params, exp_avgs, exp_avg_sqs, grad, lr, step, scale, ms.Tensor(ends), ms.Tensor(decay))  # output unused
        return before, params[-1] * 1.0                       # reads ordered around the in-place update

    update = ms.jit(update) if jit else update
    p, m, v = p0.astype(np.float64), np.zeros(n), np.zeros(n)
    for step, (lr, scale) in enumerate([(1e-2, 1.0), (5e-3, 0.5), (2e-3, 2.0)], start=1):
        g = rng.standard_normal(n).astype(np.float32)
        expected_before = p[cuts[-2]:].copy()
        p, m, v = reference_adam_step(p, m, v, g.astype(np.float64), lr, step, scale, wd, 0.9, 0.95, 1e-8, decoupled)
        before, after = update(ms.Tensor(g), ms.Tensor([lr], ms.float32), ms.Tensor([float(step)], ms.float32),
                               ms.Tensor([scale], ms.float32))
        np.testing.assert_allclose(before.asnumpy().reshape(-1), expected_before, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(after.asnumpy().reshape(-1), p[cuts[-2]:], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(concat(params), p, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(concat(exp_avgs), m, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(concat(exp_avg_sqs), v, rtol=1e-5, atol=1e-7)


def test_fused_adamw_update_does_not_depend_on_where_the_buffer_is_cut(ms, kernel_ops):
    """The same elements updated as one tensor and as tensors cut at odd places (ZeRO shards and the
    pool's tasks cut the flat buffer elsewhere than one process does): the same bits. A SIMD body with
    approximate sqrt / division (-ffast-math's rsqrt + Newton step) beside an exact scalar tail fails
    this."""
    from mindspore import Parameter

    rng = np.random.default_rng(21)
    n = 150_001
    p0, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    m0 = (0.1 * rng.standard_normal(n)).astype(np.float32)
    v0 = rng.random(n).astype(np.float32) * 1e-3
    results = []
    for cuts in ([0, n], [0, 7, 1_001, 65_539, n], [0, 3, 5, 16, 77_777, n]):
        pieces = list(zip(cuts, cuts[1:]))
        make = lambda name, a: tuple(Parameter(ms.Tensor(a[lo:hi].copy()), name=f"{name}{i}")
                                     for i, (lo, hi) in enumerate(pieces))
        params, exp_avgs, exp_avg_sqs = make("p", p0), make("m", m0), make("v", v0)
        op = kernel_ops.FusedAdamW(0.9, 0.95, 1e-8, True, tensors=len(pieces))
        for step in (1, 2):
            op(params, exp_avgs, exp_avg_sqs, ms.Tensor(g), ms.Tensor([1e-2], ms.float32),
               ms.Tensor([float(step)], ms.float32), ms.Tensor([0.7], ms.float32), ms.Tensor(np.array([n], np.int64)),
               ms.Tensor(np.array([0.1], np.float32)))
        results.append([np.concatenate([t.asnumpy() for t in group]) for group in (params, exp_avgs, exp_avg_sqs)])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)
    assert not np.array_equal(results[0][0], p0)


@MODES
def test_sum_of_squares_matches_numpy(ms, kernel_ops, jit):
    rng = np.random.default_rng(9)
    op = kernel_ops.SumOfSquares()
    run = ms.jit(op) if jit else op
    for x in (rng.standard_normal(300_001).astype(np.float32) * 3, np.float32([2.0]), rng.standard_normal((7, 5))):
        x = x.astype(np.float32)
        hi, lo = run(ms.Tensor(x)).asnumpy()
        # the float squares summed in float64: (hi, lo) carries that sum to ~48 bits
        np.testing.assert_allclose(np.float64(hi) + np.float64(lo), (x * x).astype(np.float64).sum(), rtol=1e-12)
        assert hi == np.float32(np.float64(hi) + np.float64(lo))
    inf = np.ones(100_000, np.float32)
    inf[77_777] = np.inf
    assert not np.isfinite(run(ms.Tensor(inf)).asnumpy()[0])     # the overflow check relies on this


@MODES
def test_sum_of_squares_does_not_depend_on_the_cut(ms, kernel_ops, jit):
    """The same gradients cut into other buffers, in another order (another layout's buffers and
    ranks), give the same squared norm to 1e-12 and the same float32 norm: float32 lanes were an ulp
    apart (issue 30: the pipeline's clip factor, and so its updates, drifted from its dp control)."""
    run = ms.jit(kernel_ops.SumOfSquares()) if jit else kernel_ops.SumOfSquares()
    rng = np.random.default_rng(30)
    x = (rng.standard_normal(400_003) * rng.uniform(0.0, 3.0, 400_003)).astype(np.float32)

    def total(pieces):
        return sum(float(run(ms.Tensor(np.ascontiguousarray(p))).asnumpy().astype(np.float64).sum()) for p in pieces)

    whole = total([x])
    cut = total(np.split(x[rng.permutation(x.size)], [1_000, 150_001, 150_017, 333_333]))
    assert abs(whole - cut) <= 1e-12 * whole, (whole, cut)
    assert np.float32(np.sqrt(whole)) == np.float32(np.sqrt(cut))


def test_decay_segments_merge_equal_neighbours(ms, kernel_ops):
    ends, decay = kernel_ops.decay_segments([6, 4, 3, 0, 5], [0.1, 0.1, 0.0, 0.0, 0.1])
    np.testing.assert_array_equal(ends.asnumpy(), [10, 13, 18])
    np.testing.assert_allclose(decay.asnumpy(), [0.1, 0.0, 0.1])
    with pytest.raises(ValueError, match="one weight decay per tensor"):
        kernel_ops.decay_segments([3], [])


# ----------------------------------------------------------------------------------------------
# Bad input fails the op (in a child process: after a failed op MindSpore's PyNative state can stay
# broken, and later ops in the same process fail or crash)
# ----------------------------------------------------------------------------------------------

BAD_INPUT_SETUP = """
import numpy as np
import mindspore as ms
from mindspore import Parameter
ms.set_device("CPU")
from moetrain.kernels import ops
h, head = ms.Tensor(np.ones((4, 8), np.float32)), ms.Tensor(np.ones((10, 8), np.float32))
labels = ms.Tensor(np.array([0, 9, 10, 1], np.int32))          # 10: outside a vocabulary of 10
buffers = [Parameter(ms.Tensor(np.zeros(10, np.float32)), name=f"b{i}") for i in range(3)]
one = ms.Tensor([1.0], ms.float32)
adamw = lambda ends, n=10: ops.FusedAdamW()(*([b] for b in buffers), ms.Tensor(np.ones(n, np.float32)), one, one,
                                           one, ms.Tensor(np.array(ends, np.int64)),
                                           ms.Tensor(np.zeros(len(ends), np.float32)))
try:
    (%s)[0].asnumpy()
except RuntimeError as error:
    print("REJECTED", str(error).splitlines()[0])
"""
BAD_INPUTS = {   # case: (the failing call, the kernel function that must report it)
    "slot-not-a-permutation": ("ops.UnpermuteRows()(ms.Tensor(np.ones((4, 3), np.float32)), ms.Tensor(np.array("
                               "[0, 1, 1, 3], np.int32)), ms.Tensor(np.ones((2, 2), np.float32)))", "UnpermuteRows"),
    "expert-id-out-of-range": ("ops.GroupedMatmul()(ms.Tensor(np.ones((4, 3), np.float32)), ms.Tensor(np.ones((2, 3, 5), "
                               "np.float32)), ms.Tensor(np.array([0, 1, 3, 1], np.int32)))", "GroupedMatmulNN"),
    "label-out-of-vocab": ("ops.LMHeadLogitStats(strict=True)(h, head, labels)", "LMHeadLogitStatsStrict"),
    "segments-not-ending-at-n": ("adamw([4, 9])", "AdamWUpdate"),
    "segments-not-ascending": ("adamw([6, 4, 10])", "AdamWUpdate"),
    "grad-longer-than-the-tensors": ("adamw([11], n=11)", "AdamWUpdate"),
    "position-outside-rope-table": ("ops.FusedCausalAttention()(*[ms.Tensor(np.ones((1, 4, 2, 4), np.float32))] * 3, "
                                    "ms.Tensor(np.ones((4, 4), np.float32)), ms.Tensor(np.zeros((4, 4), np.float32)), "
                                    "ms.Tensor(np.array([[0, 1, 2, 4]], np.int32)), ms.Tensor(np.zeros((1, 4), np.int32)))",
                                    "DocumentAttentionForward"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_kernel_rejects_bad_input(kernel_ops, case):
    """Each bad input fails its own kernel with a RuntimeError naming it. One child process per case:
    after a failed op MindSpore's PyNative pipeline can stay broken (a later op may report the old
    error, or crash reading the failed op's outputs)."""
    call, kernel = BAD_INPUTS[case]
    proc = subprocess.run([sys.executable, "-c", BAD_INPUT_SETUP % call], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REJECTED" in proc.stdout and f"function({kernel})" in proc.stdout, proc.stdout


# ----------------------------------------------------------------------------------------------
# The kernels' thread pool (common.h): tasks handed out dynamically, results independent of that
# ----------------------------------------------------------------------------------------------


def test_kernel_pool_runs_every_task_once_with_concurrent_callers(kernel_ops):
    """One caller and four at once (the busy pool makes the others run inline): every task of every
    call runs exactly once, on a slot below Slots()."""
    import ctypes

    from moetrain.kernels import library_path

    check = ctypes.CDLL(library_path()).MoetrainPoolCheck
    assert check(1, 37, 300) == 0
    assert check(4, 37, 300) == 0
    assert check(3, 1, 100) == 0


POOL_FORK_SCRIPT = """
import ctypes, os, sys
sys.path.insert(0, %r)
from moetrain.kernels import library_path
lib = ctypes.CDLL(library_path())
assert lib.MoetrainPoolCheck(1, 50, 20) == 0        # the parent's pool is running
pid = os.fork()
if pid == 0:                                        # the child has none of its workers: a fresh pool
    os._exit(10 + lib.MoetrainPoolCheck(2, 50, 20))
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""


def test_kernel_pool_works_in_a_forked_child(kernel_ops):
    proc = subprocess.run([sys.executable, "-c", POOL_FORK_SCRIPT % ROOT], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "child 10" in proc.stdout, proc.stdout


@MODES
def test_kernels_give_the_same_bits_every_call(ms, kernel_ops, jit):
    """Tasks go to whichever thread is free, so the split of work differs from call to call; no result
    may: the attention and grouped-GEMM (gate|up pair) gradients, the RMSNorm weight gradient (partial sums per task)
    and the LM head (per-thread dW accumulators) are bitwise equal over repeated calls."""
    from moetrain.layers import RotaryEmbedding

    rng = np.random.default_rng(11)
    tensor = lambda *shape: ms.Tensor(rng.standard_normal(shape).astype(np.float32))   # noqa: E731
    q, k, v, up = tensor(2, 130, 4, 16), tensor(2, 130, 2, 16), tensor(2, 130, 2, 16), tensor(2, 130, 4, 16)
    cos, sin = RotaryEmbedding(16, 130).tables(130)
    attention, gmm, norm = kernel_ops.FusedCausalAttention(), kernel_ops.GroupedMatmulPair(), kernel_ops.FusedRMSNorm()
    x, w, rows_up = tensor(900, 32), tensor(5, 32, 256), tensor(900, 512)
    row_expert = ms.Tensor(np.sort(rng.integers(0, 5, 900)).astype(np.int32))
    h, head, labels = tensor(300, 32), tensor(500, 32), ms.Tensor(rng.integers(0, 500, 300).astype(np.int32))
    nx, nw, eps = tensor(1000, 64), tensor(64), ms.Tensor(np.array([1e-5], np.float32))
    head_loss = kernel_ops.FusedLMHeadCrossEntropy()

    def loss(q_, k_, v_, x_, w_, h_, head_, nx_, nw_):
        return ((attention(q_, k_, v_, cos, sin) * up).sum() + (gmm(x_, w_, w_ * 2, row_expert) * rows_up).sum()
                + head_loss(h_, head_, labels) + (norm(nx_, nw_, eps) * nx).sum())

    step = grad_fn(ms, loss, tuple(range(9)), jit)
    runs = [[g.asnumpy() for g in step(q, k, v, x, w, h, head, nx, nw)[1]] for _ in range(6)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert np.array_equal(a, b)


# ----------------------------------------------------------------------------------------------
# Fallback when the kernel library cannot be built
# ----------------------------------------------------------------------------------------------

FALLBACK_SCRIPT = """
import warnings
import numpy as np
import mindspore as ms
ms.set_device("CPU")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from moetrain import kernels
    from moetrain.models.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, ffn_hidden_size=16,
                          seq_length=8))
    ids = ms.Tensor(np.zeros((1, 8), np.int32))
    loss = float(model(ids, ids)[0])
ours = [str(w.message) for w in caught if "moetrain CPU kernels unavailable" in str(w.message)]
assert not kernels.available() and model.fused_head_loss is None and np.isfinite(loss), (kernels.available(), loss)
assert len(ours) == 1, ours
print(ours[0])
"""


@pytest.mark.parametrize("breakage", ["missing-compiler", "unwritable-cache"])
def test_kernel_build_failure_falls_back_with_one_warning(tmp_path, breakage):
    env = dict(os.environ, PYTHONPATH=ROOT, MOETRAIN_DISABLE_KERNELS="0")
    if breakage == "missing-compiler":
        env["CXX"] = str(tmp_path / "no-such-g++")
        env["MOETRAIN_KERNEL_CACHE"] = str(tmp_path / "cache")
        why = "no-such-g++"
    else:
        if os.geteuid() == 0:   # root writes anywhere: make the cache path a file instead
            (tmp_path / "cache").write_text("")
            env["MOETRAIN_KERNEL_CACHE"] = str(tmp_path / "cache" / "sub")
        else:
            (tmp_path / "cache").mkdir(mode=0o500)
            env["MOETRAIN_KERNEL_CACHE"] = str(tmp_path / "cache" / "sub")
        why = "cache"
    proc = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "moetrain CPU kernels unavailable" in proc.stdout and why in proc.stdout, proc.stdout
