"""`OptimizerStep` in one process: unscale, global-norm clipping and AdamW / Adam over the flat
gradient buffers, without and with ZeRO (level 1: fp32 master rows), against a float64 numpy
reference of torch.optim.AdamW after `clip_grad_norm_`; the plain MindSpore path and the fused
kernels (`SumOfSquares` + `FusedAdamW`, where they build) must both meet it, in PyNative and jit."""
import numpy as np
import pytest

SHAPES = {"w1": (33, 17), "b1": (17,), "w2": (5, 7, 3), "norm": (21,)}     # no size a multiple of 8
LR, WEIGHT_DECAY, CLIP, INV_SCALE = 1e-2, 0.1, 1.0, 0.5


@pytest.fixture(scope="module")
def ms():
    import mindspore as ms

    ms.set_device("CPU")
    return ms


def reference(values, grads, decoupled):
    """float64: per step unscale by INV_SCALE, clip the global norm to CLIP, then AdamW (or Adam, L2)."""
    p = {k: v.astype(np.float64) for k, v in values.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    norms = []
    for step, grad in enumerate(grads, start=1):
        g = {k: x.astype(np.float64) * INV_SCALE for k, x in grad.items()}
        norm = np.sqrt(sum((x ** 2).sum() for x in g.values()))
        norms.append(norm)
        factor = min(CLIP / (norm + 1e-6), 1.0)
        for k in p:
            wd = WEIGHT_DECAY if len(SHAPES[k]) >= 2 else 0.0
            gk = g[k] * factor + (0.0 if decoupled else wd * p[k])
            m[k] = 0.9 * m[k] + 0.1 * gk
            v2[k] = 0.95 * v2[k] + 0.05 * gk * gk
            if decoupled:
                p[k] = p[k] * (1 - LR * wd)
            p[k] = p[k] - LR / (1 - 0.9 ** step) * m[k] / (np.sqrt(v2[k] / (1 - 0.95 ** step)) + 1e-8)
    return p, norms


def run_step(ms, values, grads, name, level, fused, jit):
    from mindspore import Parameter, Tensor

    from moetrain.config import OptimizerConfig, ParallelConfig
    from moetrain.distributed.topology import ParallelContext
    from moetrain.parallel.data_parallel import OptimizerStep

    params = [Parameter(Tensor(v), name=k) for k, v in values.items()]
    cfg = OptimizerConfig(name=name, lr=LR, weight_decay=WEIGHT_DECAY, beta1=0.9, beta2=0.95, eps=1e-8)
    step = OptimizerStep(params, cfg, ParallelConfig(optimizer_shard=level), ParallelContext.build(1, 0, 1),
                         clip=CLIP, jit=jit, fused=fused)
    assert step.fused == fused
    flatten = ms.jit(step.flatten) if jit else step.flatten
    norms = []
    for t, grad in enumerate(grads, start=1):
        by_name = {p.name: Tensor(grad[p.name]) for p in params}
        flats = flatten(ms.mutable(tuple(by_name[p.name] for p in step.params)))
        norm, finite = step(flats, LR, t, INV_SCALE)
        assert finite
        norms.append(norm)
    return {p.name: p.asnumpy() for p in params}, norms, step


@pytest.mark.parametrize("jit", [False, True], ids=["pynative", "jit"])
@pytest.mark.parametrize("level", [0, 1], ids=["zero0", "zero1"])
@pytest.mark.parametrize("name", ["adamw", "adam"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_optimizer_step_unscales_clips_and_updates_like_torch(ms, name, level, fused, jit):
    if fused:
        from moetrain import kernels

        if not kernels.available():
            pytest.skip("moetrain.kernels cannot be built here")
    rng = np.random.default_rng(3)
    values = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    scales = (0.01, 1.0, 0.05)     # the global norm: below the clip, above it (clipped), below again
    grads = [{k: (rng.standard_normal(s) * scale).astype(np.float32) for k, s in SHAPES.items()} for scale in scales]
    expected, expected_norms = reference(values, grads, decoupled=name == "adamw")
    got, norms, step = run_step(ms, values, grads, name, level, fused, jit)
    assert expected_norms[0] < CLIP < expected_norms[1]          # both branches of the clip ran
    np.testing.assert_allclose(norms, expected_norms, rtol=1e-5)
    for k in SHAPES:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # the moments are the optimizer's per-parameter (or per-master) Parameters either way: checkpoints
    # hold the same tensors whichever path ran
    assert len(step.optimizer.state_parameters()) == 2 * (len(SHAPES) if level == 0 else len(step.buffers))


def test_fused_optimizer_step_skips_a_non_finite_gradient(ms, monkeypatch):
    from moetrain import kernels

    if not kernels.available():
        pytest.skip("moetrain.kernels cannot be built here")
    from mindspore import Parameter, Tensor

    from moetrain.config import OptimizerConfig, ParallelConfig
    from moetrain.distributed.topology import ParallelContext
    from moetrain.parallel.data_parallel import OptimizerStep

    values = {k: np.ones(s, np.float32) for k, s in SHAPES.items()}
    params = [Parameter(Tensor(v), name=k) for k, v in values.items()]
    make = lambda fused="auto": OptimizerStep(params, OptimizerConfig(name="adamw", fused=fused),  # noqa: E731
                                              ParallelConfig(), ParallelContext.build(1, 0, 1), clip=CLIP, jit=True)
    assert not make("off").fused                                  # optimizer.fused: off: the plain path
    step = make()
    assert step.fused                                             # the default: picked where the kernels run
    grads = [np.ones(p.shape, np.float32) for p in step.params]
    grads[-1].reshape(-1)[3] = np.inf
    norm, finite = step(step.flatten(tuple(Tensor(g) for g in grads)), LR, 1, INV_SCALE)
    assert not finite and not np.isfinite(norm)
    for p in params:
        np.testing.assert_array_equal(p.asnumpy(), values[p.name])  # nothing was updated


def test_fused_norm_does_not_depend_on_how_the_gradients_are_cut(ms):
    """The same gradients laid out in other buffers (the parameters in the reverse order) give the
    same float32 norm, bitwise: the float64 sum of their float squares (issue 30: with float32 sums a
    pipeline's norm was an ulp off its dp control's, and through the clip factor every update)."""
    from moetrain import kernels

    if not kernels.available():
        pytest.skip("moetrain.kernels cannot be built here")
    from mindspore import Parameter, Tensor

    from moetrain.config import OptimizerConfig, ParallelConfig
    from moetrain.distributed.topology import ParallelContext
    from moetrain.parallel.data_parallel import OptimizerStep

    shapes = {"a": (300, 257), "b": (1000,), "c": (129, 301), "d": (77,)}
    rng = np.random.default_rng(30)
    grads = {k: (rng.standard_normal(s) * rng.uniform(0.0, 3.0, s)).astype(np.float32) for k, s in shapes.items()}
    want = np.float32(np.sqrt(sum((g * g).astype(np.float64).sum() for g in grads.values()) * INV_SCALE ** 2))
    norms = []
    for names in (list(shapes), list(shapes)[::-1]):
        params = [Parameter(Tensor(np.zeros(shapes[k], np.float32)), name=k) for k in names]
        step = OptimizerStep(params, OptimizerConfig(name="adamw"), ParallelConfig(), ParallelContext.build(1, 0, 1),
                             clip=CLIP, jit=False, fused=True)
        norm, finite = step(step.flatten(tuple(Tensor(grads[p.name]) for p in step.params)), LR, 1, INV_SCALE)
        assert finite
        norms.append(np.float32(norm))
    assert norms == [want, want], (norms, want)


@pytest.mark.parametrize("level", [0, 2], ids=["zero0", "zero2"])
def test_buffer_past_two_to_the_24_is_reduced_whole_under_jit(ms, level):
    """A buffer of 2^24 + 3 elements (MindSpore 2.10's graph arithmetic on integers goes through
    float32 there) over dp 2 in one process (SoloComm: the all-reduce is the identity, the
    reduce-scatter keeps rank 0's row), bucket 40 MB: level 0 all-reduces it in two pieces, ZeRO-2
    reduce-scatters the [2, S] rows; every value must come back in place."""
    from mindspore import Parameter, Tensor

    from moetrain.config import OptimizerConfig, ParallelConfig
    from moetrain.distributed.topology import ParallelContext
    from moetrain.parallel.data_parallel import OptimizerStep
    from moetrain.testing.solo import SoloComm

    rng = np.random.default_rng(7)
    shapes = {"w": (4096, 4096), "v": (1, 3)}      # both decay: one buffer
    grads = {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}
    params = [Parameter(Tensor(np.zeros(s, np.float32)), name=k) for k, s in shapes.items()]
    parallel = ParallelConfig(data_parallel=2, optimizer_shard=level, grad_bucket_mb=40.0)
    with SoloComm():
        step = OptimizerStep(params, OptimizerConfig(name="adamw"), parallel, ParallelContext.build(2, 0, 2),
                             clip=0.0, jit=True, fused=False)
        (b,) = step.buffers
        assert sum(b.numels) == 2 ** 24 + 3 and len(b.pieces) == (2 if level == 0 else 0)
        flats = ms.jit(step.flatten)(ms.mutable(tuple(Tensor(grads[p.name]) for p in step.params)))
        out = step._prepare(ms.mutable(tuple(flats)), Tensor(1.0, ms.float32))[0][0].asnumpy()
    by_name = {p.name: grads[p.name].reshape(-1) for p in step.params}
    if level == 0:
        expected = np.concatenate([by_name[p.name] for p in step.params])
    else:   # rank 0's row: the first ceil(n / 2) elements of each parameter
        expected = np.concatenate([by_name[p.name][:s] for p, s in zip(step.params, b.shards)])
    np.testing.assert_array_equal(out, expected)


def _zero2_step(params, bucket_mb, world=4, rank=1):
    from moetrain.config import OptimizerConfig, ParallelConfig
    from moetrain.distributed.topology import ParallelContext
    from moetrain.parallel.data_parallel import OptimizerStep

    parallel = ParallelConfig(data_parallel=world, optimizer_shard=2, grad_bucket_mb=bucket_mb)
    return OptimizerStep(params, OptimizerConfig(name="adamw"), parallel, ParallelContext.build(world, rank, world),
                         clip=0.0, jit=True, fused=False)


def test_zero2_buckets_give_each_rank_its_row_exactly(ms):
    """ZeRO-2 packs and reduce-scatters bucket by bucket (here 4 KB: several buckets in each of the
    two buffers, decay and no decay; the first, the LM head, and the last, one larger parameter
    each, in two column pieces) in
    backward order; rank 1 of dp 4 (SoloComm: the reduce-scatter
    keeps this rank's chunk) must get exactly its row, the second ceil(n / 4) elements of every
    parameter, zero-padded, as when each buffer is packed whole (one bucket). The master rows'
    all-gather into the parameters, bucket by bucket as well, must place every column."""
    from mindspore import Parameter, Tensor

    from moetrain.testing.solo import SoloComm

    rng = np.random.default_rng(3)
    from moetrain.distributed.sharding import mark_role

    shapes = {"a.weight": (40, 40), "a.bias": (701,), "b.weight": (29, 31), "b.norm": (901,), "c.weight": (5, 7, 3),
              "head.weight": (37, 41), "d.weight": (33, 17), "d.bias": (333,)}
    grads = {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}
    params = [Parameter(Tensor(np.zeros(s, np.float32)), name=k) for k, s in shapes.items()]
    mark_role(params[5], lm_head=True)     # an LM head before blocks (DeepSeek's MTP): its bucket goes first
    rows, gathered = {}, {}
    with SoloComm():
        for bucket_mb in (4 / 1024, 1e6):
            step = _zero2_step(params, bucket_mb)
            flats = ms.jit(step.flatten)(ms.mutable(tuple(Tensor(grads[p.name]) for p in step.params)))
            rows[bucket_mb] = [f.asnumpy() for f in flats]
            # the optimizer's all-gather of the master rows into the parameters, bucket by bucket too
            # (SoloComm gathers G copies of this rank's row), compiled and in PyNative
            for jit in (True, False):
                for i, master in enumerate(step.masters):
                    master.set_data(Tensor(np.arange(master.shape[0], dtype=np.float32) + 1000 * i))
                for p in params:
                    p.set_data(Tensor(np.zeros(p.shape, np.float32)))
                (ms.jit(step._gather_masters) if jit else step._gather_masters)()
                gathered[bucket_mb, jit] = {p.name: p.asnumpy().copy() for p in params}
            if bucket_mb < 1:
                assert len(step.buffers) == 2 and all(len(b.buckets) > 1 for b in step.buffers)
                firsts = [step.params[step.buffers[i].start + start].name for i, start, *_ in step.bucket_order]
                model_order = [p.name for p in params]
                assert [model_order.index(n) for n in firsts[1:]] == sorted((model_order.index(n) for n in firsts[1:]),
                                                                            reverse=True)
                # the last bucket, a.weight alone (6.4 KB of [4, 400]), goes in column pieces, and so
                # does the first, head.weight alone (6.1 KB of [4, 380]), the LM head, first wherever it sits
                assert firsts[-1] == "a.weight" and len(step.bucket_order[-1][-1]) == 2
                assert firsts[0] == "head.weight" and len(step.bucket_order[0][-1]) == 2
    for b, whole, bucketed in zip(step.buffers, rows[1e6], rows[4 / 1024]):
        expected = []
        for p, n, s in zip(step.params[b.start:b.end], b.numels, b.shards):
            padded = np.zeros(4 * s, np.float32)
            padded[:n] = grads[p.name].reshape(-1)
            expected.append(padded[s:2 * s])
        np.testing.assert_array_equal(bucketed, np.concatenate(expected))
        np.testing.assert_array_equal(whole, np.concatenate(expected))
    for i, b in enumerate(step.buffers):
        row = np.arange(b.row, dtype=np.float32) + 1000 * i
        for p, n, s, o in zip(step.params[b.start:b.end], b.numels, b.shards, b.offsets):
            want = np.tile(row[o:o + s], 4)[:n].reshape(p.shape)
            for key, got in gathered.items():
                np.testing.assert_array_equal(got[p.name], want, err_msg=str(key))


def test_zero2_buckets_free_each_layers_gradients_inside_the_jitted_backward(ms):
    """The point of the buckets: in the jitted grad step (value_and_grad + flatten, as the runner and
    the pipeline compile it) each layer's per-parameter gradients are packed and reduce-scattered as
    the backward produces them and then freed, so the pool never holds every gradient at once. 12
    layers of 4 MiB weights over dp 8: packed whole, the pool peaks above every gradient plus the
    unsharded buffer (~96 MiB); bucket by bucket (one layer each) under a third of the weights, four
    layers' worth (measured 13.4 MiB: a layer's gradient, its packed copy and the activations)."""
    from mindspore import nn, ops, Tensor

    from moetrain.planner.dryrun import PoolRecorder
    from moetrain.testing.solo import SoloComm

    layers, width = 12, 1024

    class Stack(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([nn.Dense(width, width, has_bias=False) for _ in range(layers)])

        def construct(self, x):
            for layer in self.layers:
                x = ops.tanh(layer(x))
            return x.sum()

    net = Stack()
    x = Tensor(np.random.default_rng(0).standard_normal((16, width), dtype=np.float32))
    weights = layers * width * width * 4
    peaks = {}
    with SoloComm():
        for bucket_mb in (1.0, 1e6):
            step = _zero2_step(net.trainable_params(), bucket_mb, world=8, rank=0)
            grad_fn = ms.value_and_grad(net, None, step.params)

            @ms.jit
            def grad_step(batch):
                return step.flatten(grad_fn(batch)[1])

            grad_step(x)            # compiled outside the record
            with PoolRecorder() as pool:
                grad_step(x)
            peaks[bucket_mb] = pool.peak_above_start
    assert peaks[1e6] > 1.5 * weights, peaks
    assert peaks[1.0] < weights / 3, peaks
