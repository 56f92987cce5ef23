"""The Ascend MoE ops' CPU contracts against MindSpore's documented examples, the Ascend and GPU code
paths against the CPU path in one process, mutated contracts that must make those checks fail, and
the host-side sizing of the dropless dispatch buffers (moetrain.moe.capacity)."""
import os

import numpy as np
import pytest


@pytest.fixture(scope="module")
def ms():
    import mindspore

    mindspore.set_device("CPU")   # as the trainer does: a later set_device("CPU") is then a no-op
    return mindspore


@pytest.fixture
def native_ops():
    from moetrain.moe import native_ops

    return native_ops


# ---------------------------------------------------------------------------------------------
# Contracts against the examples of the MindSpore 2.10 docstrings
# ---------------------------------------------------------------------------------------------
def test_token_permute_contract_reproduces_the_documented_example(ms, native_ops):
    tokens = np.array([[1, 1, 1], [7, 7, 7], [2, 2, 2], [1, 1, 1], [2, 2, 2], [3, 3, 3]], np.float32)
    indices = np.array([5, 0, 3, 1, 2, 4], np.int32)
    permuted, sorted_indices = native_ops.moe_token_permute(ms.Tensor(tokens), ms.Tensor(indices), False)
    np.testing.assert_array_equal(permuted.asnumpy(), [[7] * 3, [1] * 3, [2] * 3, [2] * 3, [3] * 3, [1] * 3])
    np.testing.assert_array_equal(sorted_indices.asnumpy(), [5, 0, 3, 1, 2, 4])
    assert sorted_indices.dtype == ms.int32
    # top-k: permuted[sorted_indices[t k + j]] = tokens[t], groups in ascending index order
    topk = np.array([[2, 0], [1, 2], [0, 1]], np.int32)
    permuted, sorted_indices = native_ops.moe_token_permute(ms.Tensor(tokens[:3]), ms.Tensor(topk), False)
    np.testing.assert_array_equal(permuted.asnumpy()[sorted_indices.asnumpy()], tokens[[0, 0, 1, 1, 2, 2]])
    np.testing.assert_array_equal(np.sort(topk.reshape(-1))[sorted_indices.asnumpy()], topk.reshape(-1))


def test_token_unpermute_contract_follows_the_documented_formula(ms, native_ops):
    permuted = np.array([[1, 1, 1], [0, 0, 0], [0, 0, 0], [3, 3, 3], [2, 2, 2], [1, 1, 1], [2, 2, 2],
                         [3, 3, 3]], np.float32)
    sorted_indices = np.array([0, 6, 7, 5, 3, 1, 2, 4], np.int32)
    out = native_ops.moe_token_unpermute(ms.Tensor(permuted), ms.Tensor(sorted_indices), None, False)
    assert out.shape == (8, 3)                                               # the documented shape
    np.testing.assert_array_equal(out.asnumpy(), permuted[sorted_indices])
    probs = np.array([[0.5, 2.0], [1.0, 0.0], [0.25, 0.25], [3.0, -1.0]], np.float32)
    out = native_ops.moe_token_unpermute(ms.Tensor(permuted), ms.Tensor(sorted_indices), ms.Tensor(probs), False)
    want = (probs[:, :, None] * permuted[sorted_indices].reshape(4, 2, 3)).sum(1)
    np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-6)
    with pytest.raises(ValueError, match="sorted_indices must be int32"):
        native_ops.moe_token_unpermute(ms.Tensor(permuted), ms.Tensor(sorted_indices.astype(np.int64)), None, False)


@pytest.mark.parametrize("group_list, group_list_type", [([1, 2, 1, 2], 1), ([1, 3, 4, 6], 0)],
                         ids=["sizes", "cumulative"])
def test_grouped_matmul_contract_reproduces_the_documented_example(ms, native_ops, group_list, group_list_type):
    x = np.array([[0] * 4, [1] * 4, [2] * 4, [2] * 4, [1] * 4, [1] * 4], np.float32)
    weight = np.arange(32, dtype=np.float32).reshape(4, 4, 2)
    y = native_ops.grouped_matmul_v4(ms.Tensor(x), ms.Tensor(weight), ms.Tensor(np.array(group_list, np.int64)),
                                     group_list_type, False)
    np.testing.assert_array_equal(y.asnumpy(), [[0, 0], [44, 48], [88, 96], [152, 160], [108, 112], [108, 112]])


def test_grouped_matmul_contract_leaves_rows_past_the_groups_unspecified(ms, native_ops):
    """Groups ending before the last row: those rows' outputs and input gradients are NaN (the
    docs leave them unspecified); the weight gradient counts only the grouped rows."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 3)).astype(np.float32), rng.standard_normal((2, 3, 4)).astype(np.float32)
    sizes = ms.Tensor(np.array([2, 1], np.int64))
    upstream = rng.standard_normal((5, 4)).astype(np.float32)

    def loss(x_, w_):
        y = native_ops.grouped_matmul_v4(x_, w_, sizes, 1, False)
        return (ms.ops.where(ms.Tensor(np.arange(5) < 3).reshape(-1, 1), y, 0.0) * ms.Tensor(upstream)).sum()

    y = native_ops.grouped_matmul_v4(ms.Tensor(x), ms.Tensor(w), sizes, 1, False).asnumpy()
    np.testing.assert_allclose(y[:3], np.stack([x[0] @ w[0], x[1] @ w[0], x[2] @ w[1]]), rtol=1e-5)
    assert np.isnan(y[3:]).all()
    _, (dx, dw) = ms.value_and_grad(loss, (0, 1))(ms.Tensor(x), ms.Tensor(w))
    assert np.isnan(dx.asnumpy()[3:]).all() and np.isfinite(dx.asnumpy()[:3]).all()
    want_dw = np.stack([x[:2].T @ upstream[:2], x[2:3].T @ upstream[2:3]])
    np.testing.assert_allclose(dw.asnumpy(), want_dw, rtol=1e-5)
    with pytest.raises(ValueError, match="group_list must be int64"):
        native_ops.grouped_matmul_v4(ms.Tensor(x), ms.Tensor(w), ms.Tensor(np.array([2, 1], np.int32)), 1, False)


# ---------------------------------------------------------------------------------------------
# The Ascend and GPU paths reproduce the CPU path; mutated contracts do not
# ---------------------------------------------------------------------------------------------
def moe_layer_run(ms, monkeypatch, path, jit=False, compute=None):
    """Output, input gradient and parameter gradients of one MoE layer on `path` (same weights)."""
    from moetrain.moe.config import MoEConfig
    from moetrain.moe.layer import MoELayer

    monkeypatch.setenv("MOETRAIN_MOE_PLATFORM", path)
    ms.set_seed(11)
    layer = MoELayer(12, MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=8, aux_loss_coeff=0.01))
    if compute == "bmm":
        layer.experts.compute, layer.dispatcher.layout = "bmm", "capacity"
    rng = np.random.default_rng(3)
    for param in layer.trainable_params():
        param.set_data(ms.Tensor(rng.standard_normal(param.shape).astype(np.float32) * 0.5))
    layer.expert_bias.set_data(ms.Tensor(np.array([0.0, 0.0, 0.0, -9.0], np.float32)))   # expert 3: no tokens
    x = ms.Tensor(rng.standard_normal((2, 7, 12)).astype(np.float32))
    params = layer.trainable_params()

    def loss(inputs):
        y, stats = layer(inputs)
        return (y * y).sum() + layer.weighted_aux(stats), y

    grad_fn = ms.value_and_grad(loss, 0, params, has_aux=True)
    (_, y), (dx, dparams) = (ms.jit(grad_fn) if jit else grad_fn)(x)
    return [y.asnumpy(), dx.asnumpy()] + [g.asnumpy() for g in dparams]


def max_difference(got, want):
    """Largest difference over the outputs, relative to each output's largest magnitude."""
    return max(float(np.abs(a - b).max() / np.abs(b).max()) if np.isfinite(a).all() else np.inf
               for a, b in zip(got, want))


@pytest.mark.parametrize("path, jit", [("ascend", False), ("ascend", True), ("gpu", False)])
def test_ascend_and_gpu_paths_reproduce_the_cpu_path(ms, monkeypatch, path, jit):
    want = moe_layer_run(ms, monkeypatch, "cpu")
    assert max_difference(moe_layer_run(ms, monkeypatch, path, jit), want) < 1e-5


MUTATIONS = {
    # group_list read as cumulative ends although the caller passes sizes (group_list_type 1)
    "group_list_type": ("_contract_grouped_matmul", lambda orig: lambda x, w, gl, kind: orig(x, w, gl, 1 - kind)),
    # sorted_indices as "row r holds assignment sorted_indices[r]" instead of "assignment a sits at row ..."
    "sorted_indices_inverted": ("_contract_token_permute", lambda orig: lambda tokens, indices: _inverted(orig(tokens, indices))),
}


def _inverted(result):
    from mindspore import ops

    permuted, sorted_indices = result
    inverse = ops.scatter_nd(sorted_indices.reshape(-1, 1), ops.arange(sorted_indices.shape[0], dtype=sorted_indices.dtype),
                             sorted_indices.shape)
    return permuted, inverse


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_mutated_contract_makes_the_ascend_path_differ(ms, monkeypatch, native_ops, mutation):
    """The comparison above bites: with one documented semantic changed in the contract, the
    Ascend path no longer reproduces the CPU path."""
    want = moe_layer_run(ms, monkeypatch, "cpu")
    name, mutate = MUTATIONS[mutation]
    monkeypatch.setattr(native_ops, name, mutate(getattr(native_ops, name)))
    assert max_difference(moe_layer_run(ms, monkeypatch, "ascend"), want) > 1e-3


def test_cpu_capacity_layout_without_kernels_reproduces_the_rows_layout(ms, monkeypatch):
    want = moe_layer_run(ms, monkeypatch, "cpu")
    assert max_difference(moe_layer_run(ms, monkeypatch, "cpu", compute="bmm"), want) < 1e-5


def test_alltoall_on_gpu_runs_as_allgather_with_one_log_line(ms, capsys):
    from moetrain.moe import ep_dispatcher
    from moetrain.distributed.topology import single_group

    ep_dispatcher._logged_gpu_fallback.clear()
    for _ in range(2):
        dispatcher = ep_dispatcher.build_ep_dispatcher("alltoall", 4, 2, 0.0, single_group("ep"), "capacity", "gpu")
        assert isinstance(dispatcher, ep_dispatcher.AllGatherDispatcher)
    lines = [line for line in capsys.readouterr().out.splitlines() if "AlltoAll" in line]
    assert len(lines) == 1 and "Ascend only" in lines[0] and "allgather" in lines[0]


def test_grouped_matmul_contract_takes_a_different_row_count_every_call(ms, native_ops):
    """The exact-split dispatch hands the experts R + 1 rows (R routed here, then a spare row past the
    groups), R changing every call, R = 0 included: PyNative computes each call at its own size."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 3, 4)).astype(np.float32)
    for sizes in ([0, 0], [2, 1], [1, 4]):
        rows = sum(sizes)
        x = rng.standard_normal((rows + 1, 3)).astype(np.float32)
        y = native_ops.grouped_matmul_v4(ms.Tensor(x), ms.Tensor(w), ms.Tensor(np.array(sizes, np.int64)), 1,
                                         False).asnumpy()
        group = np.repeat([0, 1], sizes)
        assert y.shape == (rows + 1, 4)
        np.testing.assert_allclose(y[:rows], np.einsum("rk,rkn->rn", x[:rows], w[group]), rtol=1e-5, atol=1e-6)
        assert np.isnan(y[rows:]).all()                 # the spare row is not computed


def test_exact_splits_on_the_ascend_path_only(ms, monkeypatch):
    """Dropless alltoall on the Ascend MoE path with Ascend's AlltoAllV (native or contract): exact
    splits, nothing for the capacity controller to size; elsewhere bucketed; parallel.ep_splits
    overrides, and refuses exact where no AlltoAllV with Tensor counts exists."""
    from moetrain.moe import ep_dispatcher
    from moetrain.distributed.topology import single_group

    monkeypatch.setenv("MOETRAIN_COMM_BACKEND", "contract")
    monkeypatch.setenv("MOETRAIN_CONTRACT_TARGET", "Ascend")
    assert ep_dispatcher.dispatch_splits("ascend") == "exact"
    assert ep_dispatcher.dispatch_splits("cpu") == "bucketed"
    exact = ep_dispatcher.build_ep_dispatcher("alltoall", 4, 2, 0.0, single_group("ep"), "rows", "ascend")
    assert exact.splits == "exact" and exact.capacity_fields() == ()
    capped = ep_dispatcher.build_ep_dispatcher("alltoall", 4, 2, 1.0, single_group("ep"), "rows", "ascend")
    assert capped.splits == "bucketed"             # capacity_factor > 0: fixed GShard buffers
    with pytest.raises(ValueError, match="exact splits need the rows layout"):
        ep_dispatcher.AllToAllDispatcher(4, 2, 0.0, single_group("ep"), "capacity", "exact")
    bucketed = ep_dispatcher.build_ep_dispatcher("alltoall", 4, 2, 0.0, single_group("ep"), "rows", "ascend",
                                                 "bucketed")
    assert bucketed.splits == "bucketed" and bucketed.capacity_fields() == ("pair_capacity",)
    monkeypatch.setenv("MOETRAIN_CONTRACT_TARGET", "GPU")
    with pytest.raises(ValueError, match="parallel.ep_splits=exact needs the Ascend MoE path with Ascend's AlltoAllV"):
        ep_dispatcher.dispatch_splits("ascend", "exact")
    assert ep_dispatcher.dispatch_splits("ascend", "auto") == "bucketed"
    monkeypatch.setenv("MOETRAIN_COMM_BACKEND", "emulated")
    monkeypatch.setenv("MOETRAIN_CONTRACT_TARGET", "Ascend")
    assert ep_dispatcher.dispatch_splits("ascend") == "bucketed"
    with pytest.raises(ValueError, match="parallel.ep_splits='fixed': use auto, exact, bucketed"):
        ep_dispatcher.dispatch_splits("ascend", "fixed")


def test_platform_and_implementation_selection(monkeypatch, native_ops):
    monkeypatch.setenv("MOETRAIN_MOE_PLATFORM", "tpu")
    with pytest.raises(ValueError, match="MOETRAIN_MOE_PLATFORM='tpu': use auto, cpu, ascend, gpu"):
        native_ops.platform()
    monkeypatch.setenv("MOETRAIN_MOE_PLATFORM", "gpu")
    assert native_ops.platform() == "gpu" and native_ops.expert_compute() == "bmm"
    assert native_ops.expert_compute("ascend") == "gmm"
    assert native_ops.implementation() == "contract"          # the Ascend ops cannot run on this CPU
    native_ops.use_contract(False)
    try:
        assert native_ops.implementation() == "native"
    finally:
        native_ops.use_contract(None)


# ---------------------------------------------------------------------------------------------
# Host-side sizing of the dropless buffers
# ---------------------------------------------------------------------------------------------
def test_bucket_pads_at_most_an_eighth():
    from moetrain.moe.capacity import bucket

    assert [bucket(r) for r in (0, 1, 16, 17, 33, 100, 1000)] == [1, 1, 16, 18, 36, 104, 1024]
    for rows in range(1, 5000):
        assert rows <= bucket(rows) <= rows * 1.125
    assert len({bucket(r) for r in range(1025, 2049)}) == 8


def alltoall_dispatcher():
    """ep=4, 8 experts (2 per rank), top-2, capacity layout: a pair capacity per destination and
    an expert capacity."""
    from moetrain.moe.ep_dispatcher import AllToAllDispatcher
    from moetrain.distributed.topology import ParallelContext

    return AllToAllDispatcher(8, 2, 0.0, ParallelContext.build(4, 0, 4, ep=4).group("ep"), "capacity")


BALANCED = np.full((4, 1, 8), 25.0)          # [world, layers, E]: T = 100 tokens a rank, 50 rows a pair


def test_controller_sizes_grows_on_overflow_and_shrinks_late(ms):
    from moetrain.moe.capacity import WINDOW, CapacityController, sized

    dispatcher = alltoall_dispatcher()
    controller = CapacityController([dispatcher], [[0, 1, 2, 3]])
    assert dispatcher.needed_capacity(BALANCED[:, 0]) == {"pair_capacity": (50,) * 4, "expert_capacity": 100}
    assert dispatcher.capacity_bound(BALANCED[:, 0]) == {"pair_capacity": (200,) * 4, "expert_capacity": 400}
    assert not controller.update(BALANCED)                    # ran at the bound: nothing overflowed
    assert dispatcher.pair_capacity == (sized(50),) * 4 and dispatcher.expert_capacity == sized(100)
    key = controller.key()
    hot = BALANCED.copy()
    hot[1, 0] = [5, 5, 5, 5, 5, 5, 85, 85]                    # rank 1 sends 170 rows to rank 3
    assert controller.update(hot)                             # -> re-run
    assert dispatcher.pair_capacity == (sized(50),) * 3 + (200,)      # grown, capped at the bound T min(k, L)
    assert dispatcher.expert_capacity == sized(75 + 85) and controller.key() != key
    for _ in range(WINDOW):                                   # a window of balanced counts: shrink back
        assert not controller.update(BALANCED)
    assert dispatcher.pair_capacity == (sized(50),) * 4 and dispatcher.expert_capacity == sized(100)


def test_adaptive_step_reruns_an_overflowing_call_with_a_new_graph(ms):
    from moetrain.moe.capacity import AdaptiveStep, CapacityController, sized

    dispatcher = alltoall_dispatcher()
    controller = CapacityController([dispatcher], [[0, 1, 2, 3]])
    dispatcher.pair_capacity, dispatcher.expert_capacity = (64,) * 4, 128
    hot = BALANCED.copy()
    hot[:, 0] = [40, 40, 20, 20, 20, 20, 20, 20]              # every rank sends 80 rows to rank 0
    seen, wraps = [], []

    def step(x):
        seen.append(dispatcher.pair_capacity)
        return x, ("expert_load",), (ms.Tensor(hot[0].astype(np.float32)),)

    adaptive = AdaptiveStep(step, lambda fn: wraps.append(fn) or fn, controller, lambda load: hot,
                            log=lambda line: None)
    assert adaptive("out")[0] == "out"
    assert seen == [(64,) * 4, (sized(80), 64, 64, 64)] and adaptive.reruns == 1 and len(wraps) == 2
    assert adaptive("again")[0] == "again" and len(wraps) == 2        # that graph is reused: no compile


def test_adaptive_step_keeps_a_bounded_number_of_graphs(ms):
    """Capacities that keep changing (drifting loads) compile new graphs; only the `max_graphs`
    most recently used stay, and a dropped one is compiled again when its capacities return."""
    from moetrain.moe.capacity import AdaptiveStep

    class Keys:                                               # a controller whose capacity set we choose
        def __init__(self):
            self.now, self.changes, self.dispatchers, self.fields = (0,), [], [None], ("capacity",)

        def key(self):
            return self.now

        def update(self, load):
            return False

        def note_largest(self):                               # the dry run's record of the largest set
            pass

    controller, wraps = Keys(), []
    adaptive = AdaptiveStep(lambda x: (x, ("expert_load",), (ms.Tensor(np.ones(8, np.float32)),)),
                            lambda fn: wraps.append(fn) or fn, controller, lambda load: load[None],
                            log=lambda line: None, max_graphs=3)
    for capacity in (1, 2, 3, 1, 4):                          # 1 is used again before 4 arrives: 2 is dropped
        controller.now = (capacity,)
        adaptive("x")
    assert list(adaptive.compiled) == [(3,), (1,), (4,)] and len(wraps) == 4
    controller.now = (2,)
    adaptive("x")
    assert len(wraps) == 5 and len(adaptive.compiled) == 3 and (3,) not in adaptive.compiled


def test_first_capacities_are_a_multiple_of_the_even_share(ms):
    from moetrain.config import ConfigError, load_config
    from moetrain.moe.capacity import CapacityController, sized, tokens_per_call

    assert tokens_per_call((ms.Tensor(1.0), ms.Tensor(np.zeros((2, 8), np.int32)))) == 16
    assert tokens_per_call((ms.Tensor(np.zeros((2, 8), np.float32)),)) == 0
    dispatcher = alltoall_dispatcher()
    CapacityController([dispatcher], [[0, 1, 2, 3]]).prime(100, prior=2.0)   # even share: 50 rows a pair
    assert dispatcher.pair_capacity == (sized(100),) * 4 and dispatcher.expert_capacity == sized(200)
    capped = alltoall_dispatcher()
    CapacityController([capped], [[0, 1, 2, 3]]).prime(100, prior=8.0)
    assert capped.pair_capacity == (200,) * 4 and capped.expert_capacity == 400           # the bounds
    primed = alltoall_dispatcher()
    CapacityController([primed], [[0, 1, 2, 3]], prior=8.0).prime(100)                  # the controller's prior
    assert primed.pair_capacity == (200,) * 4
    with pytest.raises(ValueError, match="parallel.moe_capacity_prior: must be > 0"):
        CapacityController([alltoall_dispatcher()], [[0, 1, 2, 3]], prior=0.0)
    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "moe_tiny.yaml")
    with pytest.raises(ConfigError, match=r"parallel.moe_capacity_prior': must be > 0"):
        load_config(config, ["parallel.moe_capacity_prior=0"])


def test_capacity_bound_leaves_every_buffer_at_its_bound(ms):
    """`parallel.moe_capacity: bound`: the step functions are wrapped plainly (no AdaptiveStep), so the
    dispatchers keep the bound for the whole run; the default manages them; another value is an error."""
    from moetrain.distributed.topology import ParallelContext
    from moetrain.moe.capacity import AdaptiveStep, adaptive_steps

    dispatcher = alltoall_dispatcher()
    pctx = ParallelContext.build(1, 0, 1)

    def step(ids):
        return ids, ("expert_load",), (ms.Tensor(np.full(8, 25.0, np.float32)),)

    (managed,) = adaptive_steps([dispatcher], pctx, lambda fn: fn, step)
    assert isinstance(managed, AdaptiveStep)
    (plain,) = adaptive_steps([dispatcher], pctx, lambda fn: fn, step, policy="bound")
    assert plain is step
    plain(ms.Tensor(np.zeros((4, 25), np.int32)))
    assert dispatcher.pair_capacity == () and not dispatcher.expert_capacity
    with pytest.raises(ValueError, match="parallel.moe_capacity: 'fixed' is not one of"):
        adaptive_steps([dispatcher], pctx, lambda fn: fn, step, policy="fixed")


def test_controller_gives_every_layer_the_largest_need_of_any_layer(ms):
    """Two MoE layers, a world of two ep groups: the layers share one compiled block graph, so they
    share one capacity set, sized from the largest need over layers and groups (issue 30: per-layer
    capacities ran every layer with the first layer's and lost rows)."""
    from moetrain.moe.capacity import CapacityController, sized

    first, second = alltoall_dispatcher(), alltoall_dispatcher()
    controller = CapacityController([first, second], [[0, 1, 2, 3], [4, 5, 6, 7]])
    loads = np.full((8, 2, 8), 25.0)                          # [world, layers, E]
    loads[5, 1] = [0, 0, 0, 0, 0, 0, 100, 100]                # layer 1, rank 5 -> its group's rank 3 only
    controller.update(loads)
    for dispatcher in (first, second):
        assert dispatcher.pair_capacity == (sized(50),) * 3 + (200,)     # all 200 rows: the bound T min(k, L)
        assert dispatcher.expert_capacity == sized(175)
    second.pair_capacity = (sized(50),) * 4                   # a layer that strays from the shared set
    with pytest.raises(RuntimeError, match="MoE layer 1 holds capacities"):
        controller.key()


def test_restored_controller_continues_exactly_and_refuses_another_layout(ms):
    """A checkpoint keeps the capacities and the sizing window (as JSON): a controller restored from
    it makes the same decisions as the one that saved it; another ep layout keeps its own prior."""
    import json

    from moetrain.moe.capacity import WINDOW, CapacityController

    saved, fresh = alltoall_dispatcher(), alltoall_dispatcher()
    original = CapacityController([saved], [[0, 1, 2, 3]])
    hot = BALANCED.copy()
    hot[1, 0] = [5, 5, 5, 5, 5, 5, 85, 85]
    for loads in (BALANCED, hot, BALANCED):
        original.update(loads)
    state = json.loads(json.dumps(original.state()))
    restored = CapacityController([fresh], [[0, 1, 2, 3]])
    assert restored.load_state(state) and restored.key() == original.key() != ()
    for step in range(WINDOW):                 # the shrink happens at the same step in both
        assert original.update(BALANCED) == restored.update(BALANCED)
        assert restored.key() == original.key(), step
    other = alltoall_dispatcher()
    assert not CapacityController([other], [[0, 1], [2, 3]]).load_state(state)
    assert other.pair_capacity == () and not CapacityController([other], [[0, 1, 2, 3]]).load_state({})
    # per-layer capacities of a checkpoint saved before issue 30 (possibly the undersized sets): not restored
    per_layer = {"ep_groups": [[0, 1, 2, 3]], "capacities": [{"pair_capacity": [64] * 4, "expert_capacity": 128}],
                 "history": [{"pair_capacity": [], "expert_capacity": []}]}
    assert not CapacityController([other], [[0, 1, 2, 3]]).load_state(per_layer) and other.pair_capacity == ()


def test_reused_blocks_run_with_the_first_blocks_python_constants(ms):
    """Why the controller ties every layer's capacities (issue 30): blocks built with
    `reused_block` share one compiled graph, so a Python int read in `construct` (as a dispatcher
    reads its capacities) is the first block's in every block, whatever the others hold."""
    from mindspore import nn, ops

    from moetrain.modeling import reused_block

    class Block(nn.Cell):
        @reused_block
        def __init__(self, width):
            super().__init__()
            self.width = width
            self.capacity = 3

        def construct(self, x):
            return x + ops.zeros((self.capacity,), ms.float32).sum() + self.capacity

    class Stack(nn.Cell):
        def __init__(self):
            super().__init__()
            self.blocks = nn.CellList([Block(4) for _ in range(3)])

        def construct(self, x):
            return tuple(block(x) for block in self.blocks)

    model = Stack()
    model.blocks[1].capacity = 7                              # set after construction, as the controller does
    model.blocks[2].capacity = 11
    zero = ms.Tensor(np.zeros(2, np.float32))

    @ms.jit
    def run(x):
        return model(x)

    outputs = [float(y.asnumpy()[0]) for y in run(zero)]
    assert outputs == [3.0, 3.0, 3.0]                         # every block: the first block's constant
