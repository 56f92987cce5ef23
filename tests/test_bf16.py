"""bfloat16 compute on the CPU (docs/precision.md): each fused layer in bf16 against a float64 reference on
the bf16-rounded operands, forward and backward, with the values a bf16 run stores checked to be bf16;
the plain-ops fallback against the kernels; a whole model's first-step loss and gradient norm against
fp32 within bf16 rounding. Small shapes, PyNative: a few seconds."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_gpt import randomize  # noqa: E402
from test_kernels import reference_lm_head_loss, reference_rope_attention  # noqa: E402
from test_moe_gpt import tiny_moe_config  # noqa: E402


@pytest.fixture(scope="module")
def ms():
    import mindspore

    mindspore.set_device("CPU")
    return mindspore


def rb(x):
    """float64 `x` rounded to bfloat16 (to nearest even), as float64."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def is_bf16(x):
    """True when every element of fp32 `x` is a bfloat16 value (low 16 bits zero)."""
    return not (np.asarray(x, np.float32).view(np.uint32) & 0xFFFF).any()


def close(got, want, tol, name):
    """Max error within `tol` of the reference's max magnitude (bf16 keeps 8 significant bits: 2^-8 = 0.4 %)."""
    err = np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30)
    assert err < tol, f"{name}: relative max error {err:.2e} >= {tol:g}"


BF16_TOL = 1e-2   # a few bf16 roundings (2^-9 each) between the operands and the result


def grads_of(ms, fn, inputs, params):
    """(value, [d inputs], [d params]) of `fn(*inputs)` as numpy."""
    f = ms.value_and_grad(fn, tuple(range(len(inputs))), params or None)
    value, grads = f(*[ms.Tensor(x) for x in inputs])
    dinputs, dparams = grads if params else (grads, ())
    dinputs = dinputs if isinstance(dinputs, tuple) else (dinputs,)
    return value.asnumpy(), [g.asnumpy() for g in dinputs], [g.asnumpy() for g in dparams]


def test_rounding_matches_round_to_nearest_even(ms, kernel_ops):
    """MindSpore's casts (the plain path) and the one-pass kernel round alike, forward and backward."""
    from moetrain.layers import round_bf16

    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8 + 2 ** -20), 3.14159, 1e-30, 6e4, 3.4e38,
                  np.inf, -np.inf], np.float32)
    x = np.concatenate([x, np.random.default_rng(0).standard_normal(100_000).astype(np.float32)])  # several tasks
    kernel = kernel_ops.RoundBF16()
    for rounder in (round_bf16, kernel):
        got = rounder(ms.Tensor(x)).asnumpy()
        assert is_bf16(got)
        np.testing.assert_array_equal(got, rb(x).astype(np.float32))
        assert got[1] == 1.0 and got[2] == 1 + 4 * 2 ** -8 and got[7] == np.inf     # ties to even; overflow
        _, grad = ms.value_and_grad(lambda t: (rounder(t) * ms.Tensor(x[::-1].copy())).sum())(ms.Tensor(x))
        np.testing.assert_array_equal(grad.asnumpy(), rb(x[::-1]).astype(np.float32))
    assert np.isnan(kernel(ms.Tensor(np.array([np.nan], np.float32))).asnumpy()).all()


def test_linear_bf16_matches_float64(ms, kernel_ops):
    from moetrain.layers import Linear

    ms.set_seed(0)
    rng = np.random.default_rng(0)
    layer = Linear(24, 40, 0.5, "bfloat16")
    assert layer.bf16 and isinstance(layer.matmul, kernel_ops.LinearMatmulBF16)   # 2-byte storage
    x = rng.standard_normal((70, 24)).astype(np.float32)
    up = rng.standard_normal((70, 40)).astype(np.float32)
    w = layer.weight.asnumpy().astype(np.float64)
    y = layer(ms.Tensor(x)).asnumpy()
    _, (dx,), (dw,) = grads_of(ms, lambda x_: (layer(x_) * ms.Tensor(up)).sum(), [x], layer.trainable_params())
    assert is_bf16(y) and is_bf16(dx) and is_bf16(dw)           # stored as a bf16 run stores them
    close(y, rb(x) @ rb(w).T, BF16_TOL, "y")
    close(dx, rb(up) @ rb(w), BF16_TOL, "dx")
    close(dw, rb(up).T @ rb(x), BF16_TOL, "dw")
    assert np.abs(y - x.astype(np.float64) @ w.T).max() > 1e-4    # the rounding is really there


def test_swiglu_mlp_bf16_matches_float64_and_plain_ops(ms, kernel_ops):
    from mindspore import ops

    from moetrain.layers import SwiGLUMLP

    ms.set_seed(0)
    rng = np.random.default_rng(1)
    mlp = SwiGLUMLP(16, 24, 0.3, 0.3, "bfloat16")
    assert mlp.swiglu is not None
    x = rng.standard_normal((2, 33, 16)).astype(np.float32)
    up = rng.standard_normal((2, 33, 16)).astype(np.float32)
    params = mlp.trainable_params()
    wg, wu, wd = (mlp.w_gate.weight.asnumpy().astype(np.float64), mlp.w_up.weight.asnumpy().astype(np.float64),
                  mlp.w_down.weight.asnumpy().astype(np.float64))
    run = lambda: [mlp(ms.Tensor(x)).asnumpy(), *grads_of(ms, lambda x_: (mlp(x_) * ms.Tensor(up)).sum(), [x], params)]
    y, _, (dx,), dparams = run()
    # float64 reference on the bf16 points: operands, the gate|up product, the SwiGLU output, the result
    xr = rb(x)
    gate, upp = rb(xr @ rb(wg).T), rb(xr @ rb(wu).T)
    sig = 1 / (1 + np.exp(-gate))
    hidden = rb(gate * sig * upp)
    close(y, hidden @ rb(wd).T, BF16_TOL, "y")
    assert is_bf16(y)
    dh = rb(up) @ rb(wd)
    dgate, dup = dh * upp * sig * (1 + gate * (1 - sig)), dh * gate * sig
    close(dx, dgate @ rb(wg) + dup @ rb(wu), BF16_TOL, "dx")
    flat = lambda a: a.reshape(-1, a.shape[-1])
    want = {"w_gate": flat(dgate).T @ flat(xr), "w_up": flat(dup).T @ flat(xr), "w_down": flat(rb(up)).T @ flat(hidden)}
    for p, g in zip(params, dparams):
        close(g, want[p.name.split(".")[0]], BF16_TOL, p.name)
    # the plain ops (fp32 MatMul and silu on the same rounded values) agree with the kernels
    assert mlp.bf16 and isinstance(mlp.swiglu, kernel_ops.FusedSwiGLUBF16)
    kernels = [layer.matmul for layer in (mlp.w_gate, mlp.w_up, mlp.w_down)], mlp.swiglu
    for layer in (mlp, mlp.w_gate, mlp.w_up, mlp.w_down):
        layer.bf16 = False
    for layer in (mlp.w_gate, mlp.w_up, mlp.w_down):
        layer.matmul = ops.MatMul(transpose_b=True)
    mlp.swiglu = None
    plain_y, _, (plain_dx,), _ = run()
    for layer, matmul in zip((mlp.w_gate, mlp.w_up, mlp.w_down), kernels[0]):
        layer.matmul = matmul
    for layer in (mlp, mlp.w_gate, mlp.w_up, mlp.w_down):
        layer.bf16 = True
    mlp.swiglu = kernels[1]
    close(plain_y, y.astype(np.float64), 8e-3, "plain y")
    close(plain_dx, dx.astype(np.float64), 8e-3, "plain dx")


def test_attention_bf16_matches_float64(ms, kernel_ops):
    """The fused attention with RoPE on bf16 q, k, v (the projections' bf16 outputs), fp32 inside."""
    from moetrain.layers import Attention

    ms.set_seed(0)
    rng = np.random.default_rng(2)
    layer = Attention(16, 4, 2, 8, max_positions=40, init_std=0.3, output_init_std=0.3, compute_dtype="bfloat16")
    assert layer.fused
    x = rng.standard_normal((2, 33, 16)).astype(np.float32)
    up = rng.standard_normal((2, 33, 16)).astype(np.float32)
    params = layer.trainable_params()
    y = layer(ms.Tensor(x)).asnumpy()
    _, (dx,), dparams = grads_of(ms, lambda x_: (layer(x_) * ms.Tensor(up)).sum(), [x], params)
    w = {p.name.split(".")[0]: rb(p.asnumpy()) for p in params}
    xr = rb(x)
    q, k, v = (rb(xr @ w[n].T).reshape(2, 33, -1, 8) for n in ("wq", "wk", "wv"))
    dattn = (rb(up) @ w["wo"]).reshape(2, 33, 4, 8)
    out, dq, dk, dv = reference_rope_attention(q, k, v, rb(dattn))
    attn = rb(out.reshape(2, 33, -1))
    close(y, attn @ w["wo"].T, BF16_TOL, "y")
    assert is_bf16(y)
    dxs = [rb(d).reshape(2, 33, -1) @ w[n] for d, n in ((dq, "wq"), (dk, "wk"), (dv, "wv"))]
    close(dx, sum(dxs), BF16_TOL, "dx")
    flat = lambda a: a.reshape(66, -1)
    want = {"wq": flat(rb(dq)).T @ flat(xr), "wk": flat(rb(dk)).T @ flat(xr), "wv": flat(rb(dv)).T @ flat(xr),
            "wo": flat(rb(up)).T @ flat(attn)}
    for p, g in zip(params, dparams):
        close(g, want[p.name.split(".")[0]], BF16_TOL, p.name)


def test_grouped_experts_bf16_matches_float64(ms, kernel_ops):
    """The grouped expert GEMMs (gate|up pair, SwiGLU, down) on rows sorted by expert, in bf16."""
    from moetrain.moe.experts import GroupedExperts

    ms.set_seed(0)
    rng = np.random.default_rng(3)
    experts = GroupedExperts(3, 16, 12, 0.3, "bfloat16")
    assert experts.compute == "kernel" and experts.bf16 and isinstance(experts.grouped_matmul, kernel_ops.GroupedMatmulBF16)
    row_expert = np.sort(rng.integers(0, 3, 50)).astype(np.int32)
    x = rng.standard_normal((50, 16)).astype(np.float32)
    up = rng.standard_normal((50, 16)).astype(np.float32)
    ids = ms.Tensor(row_expert)
    params = experts.trainable_params()
    y = experts(ms.Tensor(x), ids).asnumpy()
    _, (dx,), dparams = grads_of(ms, lambda x_: (experts(x_, ids) * ms.Tensor(up)).sum(), [x], params)
    assert is_bf16(y)
    wg, wu, wd = (rb(p.asnumpy())[row_expert] for p in params)          # [N, ...] each row's expert
    xr = rb(x)
    gate, upp = np.einsum("nk,nkf->nf", xr, wg), np.einsum("nk,nkf->nf", xr, wu)
    sig = 1 / (1 + np.exp(-gate))
    hidden = rb(gate * sig * upp)
    close(y, np.einsum("nf,nfh->nh", hidden, wd), BF16_TOL, "y")
    dh = np.einsum("nh,nfh->nf", rb(up), wd)
    dgate, dup = dh * upp * sig * (1 + gate * (1 - sig)), dh * gate * sig
    close(dx, np.einsum("nf,nkf->nk", dgate, wg) + np.einsum("nf,nkf->nk", dup, wu), BF16_TOL, "dx")
    per_expert = lambda a, b: np.stack([a[row_expert == e].T @ b[row_expert == e] for e in range(3)])
    want = [per_expert(xr, dgate), per_expert(xr, dup), per_expert(hidden, rb(up))]
    for p, g, w in zip(params, dparams, want):
        close(g, w, BF16_TOL, p.name)


def test_lm_head_cross_entropy_bf16_matches_float64(ms, kernel_ops):
    """bf16 hidden states and head weight, fp32 logits and loss."""
    from moetrain.layers import LMHeadCrossEntropy

    rng = np.random.default_rng(4)
    h = rng.standard_normal((60, 16)).astype(np.float32)
    w = rng.standard_normal((101, 16)).astype(np.float32)
    labels = ms.Tensor(rng.integers(0, 101, 60).astype(np.int32))
    head = LMHeadCrossEntropy("bfloat16")
    loss, (dh, dw), _ = grads_of(ms, lambda h_, w_: head(h_, w_, labels), [h, w], [])
    loss_ref, dh_ref, dw_ref = reference_lm_head_loss(rb(h), rb(w), labels.asnumpy())
    np.testing.assert_allclose(float(loss), loss_ref, rtol=1e-5)           # fp32 logits and loss: no bf16 error
    close(dh, dh_ref, BF16_TOL, "dh")
    close(dw, dw_ref, BF16_TOL, "dw")
    assert is_bf16(dh) and is_bf16(dw)
    assert abs(float(loss) - reference_lm_head_loss(h, w, labels.asnumpy())[0]) > 1e-5   # operands rounded


def first_step(ms, compute_dtype, plain=False, monkeypatch=None):
    """(loss, grad norm) of one tiny MoE GPT step from a fixed init and batch."""
    from moetrain.models.moe_gpt import MoEGPT

    if plain:
        from moetrain import kernels

        monkeypatch.setattr(kernels, "available", lambda: False)
    ms.set_seed(0)
    model = MoEGPT(tiny_moe_config(compute_dtype=compute_dtype, moe={"aux_loss_coeff": 0.01}))
    randomize(model, 0)
    ids = np.random.default_rng(7).integers(0, 40, (2, 17)).astype(np.int32)
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(lambda a, b: model(a, b)[0], None, params)
    loss, grads = grad_fn(ms.Tensor(ids[:, :-1]), ms.Tensor(ids[:, 1:]))
    if monkeypatch is not None:
        monkeypatch.undo()
    return float(loss), float(np.sqrt(sum((g.asnumpy().astype(np.float64) ** 2).sum() for g in grads)))


def test_first_step_loss_and_grad_norm_match_fp32(ms, kernel_ops, monkeypatch):
    """A whole MoE model (attention, routed experts, LM head + loss): bf16 against fp32 within bf16
    rounding, with the kernels and on the plain-ops fallback."""
    loss32, norm32 = first_step(ms, "float32")
    loss16, norm16 = first_step(ms, "bfloat16")
    plain16 = first_step(ms, "bfloat16", plain=True, monkeypatch=monkeypatch)
    assert abs(loss16 - loss32) / loss32 < 2e-3 and abs(norm16 - norm32) / norm32 < 1e-2, (loss16, loss32, norm16, norm32)
    assert loss16 != loss32                           # bf16 rounding is in effect
    assert abs(plain16[0] - loss16) / loss16 < 2e-3 and abs(plain16[1] - norm16) / norm16 < 1e-2, (plain16, loss16, norm16)


def test_plain_ops_fallback_is_logged_once(ms, monkeypatch, caplog):
    """Without the kernels a bf16 model runs the plain ops on rounded values and says so, once."""
    import logging

    from moetrain import kernels, layers

    monkeypatch.setattr(kernels, "available", lambda: False)
    layers._log_bf16_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        first = layers.Linear(8, 4, compute_dtype="bfloat16")
        layers.SwiGLUMLP(8, 4, compute_dtype="bfloat16")
    assert isinstance(first.emulated, layers.CastRoundBF16) and first.matmul.__class__.__name__ == "MatMul"
    fallback = [r for r in caplog.records if "bfloat16 compute without the moetrain CPU kernels" in r.getMessage()]
    assert len(fallback) == 1
    y = first(ms.Tensor(np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32))).asnumpy()
    assert is_bf16(y)


def test_bf16_containers_are_two_bytes_and_round_to_nearest_even(ms, kernel_ops):
    """ToBF16 stores bf16 bits in a 2-byte (float16-typed) tensor, FromBF16 reads them back exactly;
    the gradients cross them as a bf16 run's would (decoded, and rounded)."""
    x = np.random.default_rng(5).standard_normal(70_000).astype(np.float32)   # several tasks
    x[:4] = [1 + 2 ** -8, 1 + 3 * 2 ** -8, np.inf, -0.0]
    container = kernel_ops.ToBF16()(ms.Tensor(x))
    assert container.dtype == ms.float16 and container.asnumpy().itemsize == 2
    np.testing.assert_array_equal(container.asnumpy().view(np.uint16),
                                  (rb(x).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
    back = kernel_ops.FromBF16()(container).asnumpy()
    np.testing.assert_array_equal(back, rb(x).astype(np.float32))
    weight = ms.Tensor(x[::-1].copy())
    _, grad = ms.value_and_grad(lambda t: (kernel_ops.FromBF16()(kernel_ops.ToBF16()(t)) * weight).sum())(ms.Tensor(x))
    np.testing.assert_array_equal(grad.asnumpy(), rb(x[::-1]).astype(np.float32))


def test_bf16_storage_is_bitwise_the_emulation(ms, kernel_ops, monkeypatch):
    """Linear, the SwiGLU MLP and the grouped experts on 2-byte bf16 storage (`...BF16` kernels) give
    exactly the emulation's values (fp32 kernels on RoundBF16-rounded fp32 tensors), forward and
    backward: the same products on the same bf16 values, only stored in 2 bytes."""
    from moetrain import layers
    from moetrain.moe import experts as experts_module

    rng = np.random.default_rng(6)
    row_expert = ms.Tensor(np.sort(rng.integers(0, 3, 50)).astype(np.int32))
    cases = {   # name: (build, input shape, extra construct args)
        "linear": (lambda: layers.Linear(24, 40, 0.5, "bfloat16"), (3, 50, 24), ()),   # 150 rows: 2 row blocks
        "swiglu_mlp": (lambda: layers.SwiGLUMLP(16, 24, 0.3, 0.3, "bfloat16"), (2, 65, 16), ()),
        "grouped_experts": (lambda: experts_module.GroupedExperts(3, 16, 12, 0.3, "bfloat16"), (50, 16), (row_expert,)),
    }
    for name, (build, shape, extra) in cases.items():
        x = rng.standard_normal(shape).astype(np.float32)
        up = rng.standard_normal(shape[:-1] + (16 if name != "linear" else 40,)).astype(np.float32)
        results = []
        for storage in (True, False):
            with monkeypatch.context() as m:
                if not storage:   # the emulation: fp32 tensors holding bf16 values
                    m.setattr(layers, "bf16_storage", lambda dtype: False)
                    m.setattr(experts_module, "bf16_storage", lambda dtype: False)
                ms.set_seed(0)
                module = build()
            assert getattr(module, "bf16") is storage
            params = module.trainable_params()
            value, (dx,), dparams = grads_of(ms, lambda x_: (module(x_, *extra) * ms.Tensor(up)).sum(), [x], params)
            results.append([module(ms.Tensor(x), *extra).asnumpy(), dx, *dparams])
        for got, want in zip(*results):
            np.testing.assert_array_equal(got, want, err_msg=name)


# --- bf16 containers never leave the method that makes them (docs/precision.md) -------------------------

CONTAINER_OPS = {"ToBF16", "FusedSwiGLUBF16", "GroupedMatmulBF16", "GroupedMatmulPairBF16"}   # always a container out
CONTAINER_IF_FIRST = {"LinearMatmulBF16"}   # a container out when its first input is one
CONTAINER_READERS = CONTAINER_OPS | CONTAINER_IF_FIRST | {"FromBF16"}


def _container_op_attrs(cls):
    """{attribute: op class name} for `self.a = shared(Op)` / `self.a = Op()` (tuples too) in `cls`."""
    import ast

    attrs = {}
    for node in ast.walk(cls):
        if not isinstance(node, ast.Assign):
            continue
        targets = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else node.targets
        values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
        for target, value in zip(targets, values):
            names = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
            op = next(iter(names & CONTAINER_READERS), None)
            on_self = isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
            if op and on_self:
                attrs[target.attr] = op
    return attrs


def container_violations(source: str, where: str):
    """(methods that make a bf16 container, violations) in `source`: a container (an expression from a
    container op, or a local name bound to one) that is read twice, returned, stored anywhere but a
    local name, put in a tuple/list, or handed to anything but the kernel ops and `.reshape`."""
    import ast

    makers, bad = [], []
    for cls in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)):
        ops_ = _container_op_attrs(cls)
        if not ops_:
            continue
        for method in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            # the bf16 storage code: a method named for it, or the branches under `if self.bf16 ...`
            regions = [method] if "bf16" in method.name else [
                ast.Module(body=n.body, type_ignores=[]) for n in ast.walk(method) if isinstance(n, ast.If) and any(
                    isinstance(a, ast.Attribute) and a.attr == "bf16" for a in ast.walk(n.test))]
            for fn in regions:
                _check_region(fn, ops_, f"{where}:{cls.name}.{method.name}", method.name, makers, bad)
    return makers, bad


def _reads(node, name):
    """How often a path through `node` reads `name` at most: the branches of an if are alternatives, and
    so are an if's body that ends in `return` and the statements after it."""
    import ast

    if isinstance(node, list):   # a statement list
        for i, stmt in enumerate(node):
            if isinstance(stmt, ast.If) and stmt.body and isinstance(stmt.body[-1], ast.Return):
                before = sum(_reads(n, name) for n in node[:i]) + _reads(stmt.test, name)
                return before + max(_reads(stmt.body, name), _reads(stmt.orelse + node[i + 1:], name))
        return sum(_reads(n, name) for n in node)
    if isinstance(node, ast.IfExp):
        return _reads(node.test, name) + max(_reads(node.body, name), _reads(node.orelse, name))
    if isinstance(node, ast.If):
        return _reads(node.test, name) + max(_reads(node.body, name), _reads(node.orelse, name))
    if isinstance(node, (ast.FunctionDef, ast.Module)):
        return _reads(node.body, name)
    here = int(isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id == name)
    return here + sum(_reads(child, name) for child in ast.iter_child_nodes(node))


def _check_region(fn, ops_, here, method, makers, bad):
    """`container_violations` on one region of bf16 storage code (appends to makers and bad)."""
    import ast

    names = set()

    def op_of(call):
        f = call.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
            return ops_.get(f.attr)
        return None

    def is_container(e):
        if isinstance(e, ast.Name):
            return e.id in names
        if isinstance(e, ast.Call):
            op = op_of(e)
            if op in CONTAINER_OPS:
                return True
            if op in CONTAINER_IF_FIRST:
                return bool(e.args) and is_container(e.args[0])
            f = e.func
            return isinstance(f, ast.Attribute) and f.attr == "reshape" and is_container(f.value)
        return False

    for node in ast.walk(fn):   # bindings first (the methods are straight-line code)
        if isinstance(node, ast.Assign) and is_container(node.value):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    names.add(t.id)
                else:
                    bad.append(f"{here}: a container stored in {ast.unparse(t)}")
    made = False
    loads = {n: _reads(fn, n) for n in names}
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and op_of(node) in CONTAINER_OPS:
            made = True
        if isinstance(node, ast.Return) and node.value is not None:
            vals = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            bad += [f"{here}: returns a container" for v in vals if is_container(v)]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            elts = node.values if isinstance(node, ast.Dict) else node.elts
            if not isinstance(getattr(node, "ctx", None), ast.Store) and any(is_container(e) for e in elts):
                bad.append(f"{here}: a container in a {type(node).__name__.lower()}")
        if isinstance(node, ast.Call):
            reader = op_of(node) in CONTAINER_READERS or (
                isinstance(node.func, ast.Attribute) and node.func.attr == "reshape")
            args = list(node.args) + [k.value for k in node.keywords]
            if not reader and any(is_container(a) for a in args):
                bad.append(f"{here}: a container handed to {ast.unparse(node.func)}")
    bad += [f"{here}: container {n!r} read {c} times on one path" for n, c in loads.items() if c > 1]
    bad += [f"{here}: container {n!r} never read" for n, c in loads.items() if c == 0]
    if made:
        makers.append(here.split(":")[-1])


def test_bf16_containers_have_one_consumer_in_the_method_that_makes_them():
    """Every bf16 container is made and consumed inside one method, by exactly one op (a second consumer
    would make MindSpore add two gradients in fp16): checked statically over moetrain/, so a new maker is
    covered as soon as it is written. The checker itself is shown to catch each kind of escape."""
    import glob

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "moetrain")
    makers, bad = [], []
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        with open(path) as fh:
            m, b = container_violations(fh.read(), os.path.relpath(path, root))
        makers += m
        bad += b
    assert not bad, "\n".join(bad)
    assert sorted(makers) == ["GroupedExperts._kernel_rows", "SwiGLUMLP._bf16_storage"], makers

    template = """
class M:
    def __init__(self):
        self.to_bf16, self.matmul, self.from_bf16 = shared(ToBF16), shared(LinearMatmulBF16), shared(FromBF16)
    def f_bf16(self, x, w):
        c = self.matmul(self.to_bf16(x), w)
        BODY
"""
    ok = "return self.from_bf16(c.reshape(-1, 4))"
    assert container_violations(template.replace("BODY", ok), "t") == (["M.f_bf16"], [])
    for escape in ("return c", "return self.from_bf16(c), c", "self.saved = c\n        return self.from_bf16(c)",
                   "return self.from_bf16(self.matmul(c, w)) + self.from_bf16(c)", "return helper(c)",
                   "return self.from_bf16(c) if c is not None else None", "return [self.from_bf16(x), c]"):
        _, found = container_violations(template.replace("BODY", escape), "t")
        assert found, f"not caught: {escape}"
