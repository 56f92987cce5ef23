"""Optimizers against numpy references of their published update rules; lr schedules."""
import math

import numpy as np
import pytest

from moetrain.config import LRScheduleConfig, OptimizerConfig
from moetrain.optim import build_optimizer, lr_at


def run_optimizer(name, steps=4, **kw):
    import mindspore as ms
    from mindspore import Parameter, Tensor

    rng = np.random.default_rng(0)
    w0, b0 = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    grads = [(rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32))
             for _ in range(steps)]
    params = [Parameter(Tensor(w0), name="w"), Parameter(Tensor(b0), name="b")]
    cfg = OptimizerConfig(name=name, **kw)
    opt = build_optimizer(params, cfg)

    @ms.jit
    def step_fn(g, lr, t):
        return opt(g, lr, t)

    for t, (gw, gb) in enumerate(grads, 1):
        step_fn(ms.mutable((Tensor(gw), Tensor(gb))), Tensor(0.1, ms.float32), Tensor(t, ms.int32))
    return [w0, b0], grads, [p.asnumpy() for p in params], cfg


def test_adamw_matches_reference():
    init, grads, got, cfg = run_optimizer("adamw", weight_decay=0.1, beta2=0.99)
    for i, p in enumerate(init):            # torch.optim.AdamW; no decay on the 1-d bias
        p, m, v = p.astype(np.float64), 0.0, 0.0
        wd = cfg.weight_decay if p.ndim >= 2 else 0.0
        for t, g in enumerate(grads, 1):
            g = g[i]
            p = p * (1 - 0.1 * wd)
            m = cfg.beta1 * m + (1 - cfg.beta1) * g
            v = cfg.beta2 * v + (1 - cfg.beta2) * g * g
            p = p - 0.1 * (m / (1 - cfg.beta1 ** t)) / (np.sqrt(v / (1 - cfg.beta2 ** t)) + cfg.eps)
        np.testing.assert_allclose(got[i], p, rtol=2e-5, atol=2e-6)


def test_momentum_and_lamb_match_reference():
    init, grads, got, cfg = run_optimizer("momentum", momentum=0.9, weight_decay=0.01)
    for i, p in enumerate(init):
        p, buf = p.astype(np.float64), 0.0
        for g in grads:
            g = g[i] + (0.01 * p if p.ndim >= 2 else 0)
            buf = 0.9 * buf + g
            p = p - 0.1 * buf
        np.testing.assert_allclose(got[i], p, rtol=1e-5, atol=1e-6)
    init, grads, got, cfg = run_optimizer("lamb", weight_decay=0.01)
    for i, p in enumerate(init):
        p, m, v = p.astype(np.float64), 0.0, 0.0
        for t, g in enumerate(grads, 1):
            g = g[i]
            m = cfg.beta1 * m + (1 - cfg.beta1) * g
            v = cfg.beta2 * v + (1 - cfg.beta2) * g * g
            r = (m / (1 - cfg.beta1 ** t)) / (np.sqrt(v / (1 - cfg.beta2 ** t)) + cfg.eps)
            r = r + (0.01 * p if p.ndim >= 2 else 0)
            p = p - 0.1 * (np.linalg.norm(p) / np.linalg.norm(r)) * r
        np.testing.assert_allclose(got[i], p, rtol=2e-5, atol=2e-6)


def test_schedules():
    cos = LRScheduleConfig(type="cosine", warmup_steps=10, min_lr=0.1)
    assert lr_at(0, 1.0, cos, 110) == pytest.approx(0.1)        # warm-up from lr/warmup
    assert lr_at(9, 1.0, cos, 110) == pytest.approx(1.0)
    assert lr_at(60, 1.0, cos, 110) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, 1.0, cos, 110) == pytest.approx(0.1)
    lin = LRScheduleConfig(type="linear")
    assert lr_at(25, 2.0, lin, 100) == pytest.approx(1.5)
    assert lr_at(5, 2.0, LRScheduleConfig(type="constant"), 100) == 2.0
