"""Speed work of issue 8: the fused CPU kernels against numpy, the exact dropless MoE layout against
the padded-block one, the step metrics (mfu, peak RSS), the profiler window, and tools/bench.py."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ms():
    import mindspore

    mindspore.set_device("CPU")   # as the trainer does: a later set_device("CPU") is then a no-op
    return mindspore


@pytest.fixture(scope="module")
def kernel_ops(ms):
    from moetrain import kernels

    if not kernels.available():
        pytest.skip("moetrain.kernels cannot be built here (no C++ compiler or no oneDNN in MindSpore)")
    from moetrain.kernels import ops

    return ops


def value_and_grads(ms, fn, argnums, jit):
    grad_fn = ms.value_and_grad(fn, argnums)
    return ms.jit(grad_fn) if jit else grad_fn


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("jit", [False, True], ids=["pynative", "jit"])
def test_grouped_matmul_matches_numpy(ms, kernel_ops, jit):
    rng = np.random.default_rng(0)
    rows, k, f, experts = 70, 12, 20, 5
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((experts, k, f)).astype(np.float32)
    row_expert = np.sort(rng.integers(0, experts - 1, rows)).astype(np.int32)   # expert 4 owns no row
    row_expert[50:] = rng.integers(0, experts - 1, rows - 50)                    # an unsorted tail too
    upstream = rng.standard_normal((rows, f)).astype(np.float32)
    op = kernel_ops.GroupedMatmul()

    def loss(x_, w_):
        return (op(x_, w_, ms.Tensor(row_expert)) * ms.Tensor(upstream)).sum()

    value, (dx, dw) = value_and_grads(ms, loss, (0, 1), jit)(ms.Tensor(x), ms.Tensor(w))
    y_ref = np.stack([x[n] @ w[row_expert[n]] for n in range(rows)])
    dx_ref = np.stack([upstream[n] @ w[row_expert[n]].T for n in range(rows)])
    dw_ref = np.zeros_like(w)
    for n in range(rows):
        dw_ref[row_expert[n]] += np.outer(x[n], upstream[n])
    np.testing.assert_allclose(op(ms.Tensor(x), ms.Tensor(w), ms.Tensor(row_expert)).asnumpy(), y_ref,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(value), (y_ref * upstream).sum(), rtol=1e-5)
    np.testing.assert_allclose(dx.asnumpy(), dx_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw.asnumpy(), dw_ref, rtol=1e-5, atol=1e-5)
    assert not dw.asnumpy()[4].any()


def test_grouped_matmul_rejects_expert_out_of_range(ms, kernel_ops):
    op = kernel_ops.GroupedMatmul()
    x, w = ms.Tensor(np.ones((4, 3), np.float32)), ms.Tensor(np.ones((2, 3, 5), np.float32))
    with pytest.raises(RuntimeError):      # E (= 2) marks padding; E + 1 is out of range
        op(x, w, ms.Tensor(np.array([0, 1, 3, 1], np.int32))).asnumpy()


@pytest.mark.parametrize("jit", [False, True], ids=["pynative", "jit"])
def test_fused_swiglu_matches_numpy(ms, kernel_ops, jit):
    rng = np.random.default_rng(1)
    gate_up = (4 * rng.standard_normal((3, 7, 2 * 9))).astype(np.float32)
    gate_up[0, 0, :2] = [-200.0, 200.0]          # saturated sigmoid stays finite
    upstream = rng.standard_normal((3, 7, 9)).astype(np.float32)
    op = kernel_ops.FusedSwiGLU()

    def loss(gu):
        return (op(gu) * ms.Tensor(upstream)).sum()

    _, grad = value_and_grads(ms, loss, 0, jit)(ms.Tensor(gate_up))
    gate, up = gate_up[..., :9].astype(np.float64), gate_up[..., 9:].astype(np.float64)
    sig = 1.0 / (1.0 + np.exp(-gate))
    np.testing.assert_allclose(op(ms.Tensor(gate_up)).asnumpy(), gate * sig * up, rtol=1e-5, atol=1e-5)
    grad_ref = np.concatenate([upstream * up * sig * (1 + gate * (1 - sig)), upstream * gate * sig], -1)
    np.testing.assert_allclose(grad.asnumpy(), grad_ref, rtol=1e-5, atol=1e-4)
    nan_in = gate_up.copy()
    nan_in[1, 2, 3] = np.nan
    assert np.isnan(op(ms.Tensor(nan_in)).asnumpy()[1, 2, 3])   # overflow checks must see NaN


@pytest.mark.parametrize("jit", [False, True], ids=["pynative", "jit"])
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


def reference_causal_attention(q, k, v, upstream):
    """float64 numpy: output and gradients of sum(upstream * softmax(q k^T + causal) v), GQA."""
    batch, seq, q_heads, _ = q.shape
    group = q_heads // k.shape[2]
    q64, k64, v64 = q.astype(np.float64), np.repeat(k, group, 2).astype(np.float64), np.repeat(v, group, 2)
    scores = np.einsum("bihd,bjhd->bhij", q64, k64)
    scores[:, :, np.triu(np.ones((seq, seq), bool), 1)] = -np.inf
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bhij,bjhd->bihd", probs, v64)
    dprobs = np.einsum("bihd,bjhd->bhij", upstream, v64)
    dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True))
    dq = np.einsum("bhij,bjhd->bihd", dscores, k64)
    fold = (batch, seq, k.shape[2], group, q.shape[3])        # sum the gradients of a K/V group's heads
    dk = np.einsum("bhij,bihd->bjhd", dscores, q64).reshape(fold).sum(3)
    dv = np.einsum("bhij,bihd->bjhd", probs, upstream).reshape(fold).sum(3)
    return out, dq, dk, dv


@pytest.mark.parametrize("jit", [False, True], ids=["pynative", "jit"])
def test_fused_causal_attention_matches_numpy(ms, kernel_ops, jit):
    rng = np.random.default_rng(4)
    batch, seq, q_heads, kv_heads, dim = 2, 150, 4, 2, 8      # 150: a partial 64-row block; GQA groups of 2
    q = (0.5 * rng.standard_normal((batch, seq, q_heads, dim))).astype(np.float32)
    k = rng.standard_normal((batch, seq, kv_heads, dim)).astype(np.float32)
    v = rng.standard_normal((batch, seq, kv_heads, dim)).astype(np.float32)
    upstream = rng.standard_normal((batch, seq, q_heads, dim)).astype(np.float32)
    op = kernel_ops.FusedCausalAttention()

    def loss(q_, k_, v_):
        return (op(q_, k_, v_) * ms.Tensor(upstream)).sum()

    _, grads = value_and_grads(ms, loss, (0, 1, 2), jit)(ms.Tensor(q), ms.Tensor(k), ms.Tensor(v))
    expected = reference_causal_attention(q, k, v, upstream)
    got = [op(ms.Tensor(q), ms.Tensor(k), ms.Tensor(v)).asnumpy()] + [g.asnumpy() for g in grads]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("jit", [False, True], ids=["pynative", "jit"])
def test_exact_dropless_layout_equals_capacity_layout(ms, kernel_ops, jit):
    """Same weights, same routing: the rows layout (grouped GEMM kernel, padding rows skipped) and
    the capacity layout (batched matmul) give the same output and gradients."""
    from moetrain.moe.config import MoEConfig
    from moetrain.moe.layer import MoELayer

    cfg = MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=16, aux_loss_coeff=0.01)
    ms.set_seed(0)
    layer = MoELayer(12, cfg)
    assert (layer.experts.compute, layer.dispatcher.layout) == ("kernel", "rows")   # the default here
    x = ms.Tensor(np.random.default_rng(2).standard_normal((2, 15, 12)).astype(np.float32))
    params = layer.trainable_params()

    def run(compute, layout):
        layer.experts.compute, layer.dispatcher.layout = compute, layout

        def loss(inputs):
            y, stats = layer(inputs)
            return (y * y).sum() + layer.weighted_aux(stats), stats["expert_rows"]

        grad_fn = ms.value_and_grad(loss, 0, params, has_aux=True)
        (value, rows), (dx, dparams) = (ms.jit(grad_fn) if jit else grad_fn)(x)
        return float(rows.asnumpy()), [value.asnumpy(), dx.asnumpy()] + [g.asnumpy() for g in dparams]

    (exact_rows, exact), (capacity_rows, capacity) = run("kernel", "rows"), run("bmm", "capacity")
    assert exact_rows == 2 * 15 * 2 and capacity_rows == 4 * 2 * 15      # routed rows; E x T at the bound
    for name, a, b in zip(["loss", "dx"] + [p.name for p in params], exact, capacity):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


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


# ----------------------------------------------------------------------------------------------
# Trainer metrics and the profiler window
# ----------------------------------------------------------------------------------------------

def tiny_lm_config(tmp_path, **logging):
    from moetrain.config import config_from_dict
    from tools.bench import write_random_shard

    shard = str(tmp_path / "tokens")
    write_random_shard(shard, 64, 4000)
    return config_from_dict({
        "model": {"name": "moe_gpt", "vocab_size": 64, "hidden_size": 16, "num_layers": 1, "num_heads": 2,
                  "ffn_hidden_size": 32, "seq_length": 16, "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8}},
        "data": {"type": "lm", "path": shard},
        "train": {"steps": 3, "global_batch_size": 4, "output_dir": str(tmp_path / "run")},
        "checkpoint": {"save_at_end": False},
        "logging": {"tensorboard": False, "progress_bar": False, **logging}})


def flops_per_token_by_hand(m) -> float:
    """6 x (LM head + per layer q,k,v,o + router + top_k experts' three matrices) + 12 L a d S."""
    head_dim = m.hidden_size // m.num_heads
    attention = m.hidden_size * head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    per_layer = attention + m.moe.num_experts * m.hidden_size + 3 * m.hidden_size * m.moe.ffn_hidden_size * m.moe.top_k
    matmul_params = m.vocab_size * m.hidden_size + m.num_layers * per_layer
    return 6 * matmul_params + 12 * m.num_layers * m.num_heads * head_dim * m.seq_length


def test_profiler_window_and_step_metrics(ms, tmp_path):
    from moetrain.devices import get_device
    from moetrain.trainer import Trainer

    cfg = tiny_lm_config(tmp_path, profile_steps=[2, 3])
    Trainer(cfg).fit()
    profile_dir = tmp_path / "run" / "profile"
    tables = list(profile_dir.glob("*/FRAMEWORK/cpu_op_type_info_*.csv"))
    assert tables, f"no per-op table under {profile_dir}: {sorted(p.name for p in profile_dir.rglob('*'))}"
    assert "MatMul" in tables[0].read_text()
    with open(tmp_path / "run" / "metrics.jsonl") as fh:
        records = [json.loads(line) for line in fh]
    peak = get_device("cpu").peak("float32")
    for record in records:
        expected = record["tokens_per_s"] * flops_per_token_by_hand(cfg.model) / peak
        assert record["mfu"] == pytest.approx(expected, rel=1e-9)
        assert 400 < record["peak_rss_mb"] < 20000            # MindSpore alone takes ~410 MB


def test_profile_steps_validated(tmp_path):
    from moetrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"logging.profile_steps.*1 <= first <= last"):
        tiny_lm_config(tmp_path, profile_steps=[3, 2])


# ----------------------------------------------------------------------------------------------
# tools/bench.py
# ----------------------------------------------------------------------------------------------

def test_bench_prints_one_sane_json_line(ms):
    from moetrain.config import model_config_from_dict
    from tools.bench import model_section, parse_args

    argv = ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "32", "--experts", "4",
            "--topk", "2", "--vocab", "128", "--seq", "32", "--batch", "2", "--steps", "3", "--warmup", "1",
            "--peak-matmul-size", "512"]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench.py"), *argv], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0])
    assert result["config"]["model"] == "moe_gpt" and result["config"]["experts"] == 4
    for key in ("tokens_per_s", "step_ms_median", "cpu_ms_median", "peak_gflops", "peak_rss_mb"):
        assert result[key] > 0, key
    assert 0 < result["mfu"] <= 1
    assert result["step_ms_min"] <= result["step_ms_median"] <= result["step_ms_max"]
    # the fields agree with each other and with a FLOP count made by hand
    tokens = 2 * 32
    assert result["tokens_per_s"] == pytest.approx(tokens / (result["step_ms_median"] / 1e3), rel=2e-3)
    model = model_config_from_dict(model_section(parse_args(argv)))
    flops = flops_per_token_by_hand(model) * result["tokens_per_s"]
    assert result["model_gflops_per_s"] == pytest.approx(flops / 1e9, rel=2e-2, abs=0.01)
    assert result["mfu"] == pytest.approx(flops / (result["peak_gflops"] * 1e9), rel=2e-2, abs=2e-4)
    assert np.isfinite(result["loss_first"]) and result["drop_rate"] == 0.0
