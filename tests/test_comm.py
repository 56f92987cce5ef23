"""moetrain.dist.comm against numpy: every op and its gradient on 4 msrun ranks (PyNative and
ms.jit, world and 2-rank sub-groups), byte ledgers against their formulas, and the single-process
behaviour (trivial groups, argument errors)."""
import numpy as np
import pytest

from distributed import run_workers
from workers.comm_cases import CASES, WORLD, a2av_counts, case_input, group_ranks, loss_weight

REGION_OPS = {"copy_to_region", "reduce_from_region", "scatter_to_region", "gather_from_region"}


# ---------------------------------------------------------------------------------------------
# numpy reference: the global view of one op, every rank's output from every rank's input
# ---------------------------------------------------------------------------------------------
def reference(op, kind, kw, xs):
    ys = {}
    for r in range(WORLD):
        ranks = group_ranks(kind, r)
        pos, n = ranks.index(r), len(ranks)
        members = [xs[i] for i in ranks]
        if op in ("all_reduce", "reduce_from_region"):
            y = np.sum(members, axis=0)
        elif op in ("all_gather", "gather_from_sequence", "gather_from_region"):
            y = np.concatenate(members, axis=kw["axis"])
        elif op in ("reduce_scatter", "reduce_scatter_to_sequence"):
            y = np.split(np.sum(members, axis=0), n, axis=kw["axis"])[pos]
        elif op == "all_to_all":
            y = np.concatenate([np.split(x, n, kw["split_axis"])[pos] for x in members], kw["concat_axis"])
        elif op == "all_to_all_v":
            parts = []
            for src in ranks:
                start = sum(a2av_counts(src, j) for j in range(r))
                parts.append(xs[src][start:start + a2av_counts(src, r)])
            y = np.concatenate(parts, 0)
        elif op == "broadcast":
            y = xs[ranks[kw["src"]]]
        elif op == "copy_to_region":
            y = xs[r]
        elif op == "scatter_to_region":
            y = np.split(xs[r], n, kw["axis"])[pos]
        else:
            raise ValueError(op)
        ys[r] = y
    return ys


def reference_grads(op, kind, kw, xs, ws):
    """d(sum_r <w_r, y_r>)/dx_r by brute force over basis inputs (the ops are linear), or the
    defined backward for the Megatron region mappings whose loss is replicated over the group."""
    if op in REGION_OPS:
        grads = {}
        for r in range(WORLD):
            ranks = group_ranks(kind, r)
            if op == "copy_to_region":
                grads[r] = np.sum([ws[i] for i in ranks], axis=0)
            elif op == "reduce_from_region":
                grads[r] = ws[r]
            elif op == "scatter_to_region":
                grads[r] = np.concatenate([ws[i] for i in ranks], axis=kw["axis"])
            else:
                grads[r] = np.split(ws[r], len(ranks), kw["axis"])[ranks.index(r)]
        return grads
    grads = {r: np.zeros_like(xs[r], dtype=np.float64) for r in range(WORLD)}
    for r in range(WORLD):
        for idx in np.ndindex(xs[r].shape):
            basis = {i: np.zeros_like(xs[i]) for i in range(WORLD)}
            basis[r][idx] = 1.0
            ys = reference(op, kind, kw, basis)
            grads[r][idx] = sum(float(np.sum(ws[i] * ys[i])) for i in range(WORLD))
    return grads


def case_arrays(name, shape_of, op, kind, kw):
    xs = {r: case_input(name, r, shape_of(r)) for r in range(WORLD)}
    ys = reference(op, kind, kw, xs)
    ws = {r: loss_weight(name, r, ys[r].shape) for r in range(WORLD)}
    return xs, ys, ws


# ---------------------------------------------------------------------------------------------
# one 4-rank job for the whole module
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def comm_job(tmp_path_factory):
    run = run_workers("tests/workers/comm_worker.py", nproc=4, timeout=240,
                      job_dir=str(tmp_path_factory.mktemp("comm_job"))).check()
    assert not run.leftovers, f"processes survived the job: {run.leftovers}"
    return run.npz_results(), run.json_results()


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["pynative", "jit"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_op_and_gradient_match_numpy(comm_job, case, mode):
    arrays, _ = comm_job
    name, op, kind, shape_of, kw = case
    xs, ys, ws = case_arrays(name, shape_of, op, kind, kw)
    grads = reference_grads(op, kind, kw, xs, ws)
    for r in range(WORLD):
        got_y, got_dx = arrays[r][f"{mode}/{name}/y"], arrays[r][f"{mode}/{name}/dx"]
        assert got_y.shape == ys[r].shape, f"rank {r}: output shape {got_y.shape} != {ys[r].shape}"
        np.testing.assert_allclose(got_y, ys[r], rtol=1e-6, atol=1e-6, err_msg=f"{name} {mode} rank {r} output")
        np.testing.assert_allclose(got_dx, grads[r], rtol=1e-5, atol=1e-5, err_msg=f"{name} {mode} rank {r} grad")


@pytest.mark.distributed
def test_data_movement_is_bit_exact(comm_job):
    """Gathers, all-to-alls and broadcasts add exact zeros in the CPU emulation: bitwise equal."""
    arrays, _ = comm_job
    for name, op, kind, shape_of, kw in CASES:
        if op in ("all_gather", "all_to_all", "all_to_all_v", "broadcast", "gather_from_region"):
            xs, ys, _ = case_arrays(name, shape_of, op, kind, kw)
            for r in range(WORLD):
                np.testing.assert_array_equal(arrays[r][f"jit/{name}/y"], ys[r], err_msg=f"{name} rank {r}")


@pytest.mark.distributed
def test_inf_stays_in_its_slot(comm_job):
    arrays, _ = comm_job
    expected = np.concatenate([np.zeros((2, 2), np.float32) + r for r in range(WORLD)])
    expected[2, 0] = np.inf
    for r in range(WORLD):
        np.testing.assert_array_equal(arrays[r]["inf/y"], expected)


# ---------------------------------------------------------------------------------------------
# byte ledgers: what each rank sends, per group kind
# ---------------------------------------------------------------------------------------------
def ring(n, nbytes):
    return 2 * (n - 1) / n * nbytes


def expected_traffic(op, n, size, kw, rank):
    """(native fwd, emulated fwd, native bwd, emulated bwd) bytes for one call on this rank."""
    if op == "all_reduce":
        return ring(n, size), ring(n, size), ring(n, size), ring(n, size)
    if op in ("all_gather", "gather_from_sequence"):
        return (n - 1) * size, ring(n, n * size), (n - 1) * size, ring(n, n * size)
    if op in ("reduce_scatter", "reduce_scatter_to_sequence"):
        return (n - 1) / n * size, ring(n, size), (n - 1) / n * size, ring(n, size)
    if op == "all_to_all":
        return (n - 1) / n * size, ring(n, n * size), (n - 1) / n * size, ring(n, n * size)
    if op == "all_to_all_v":
        row = 2 * 4
        capacity = max([a2av_counts(rank, j) for j in range(n)] + [a2av_counts(i, rank) for i in range(n)])
        emulated = ring(n, n * n * capacity * row)
        sent = sum(a2av_counts(rank, j) for j in range(n) if j != rank) * row
        received = sum(a2av_counts(i, rank) for i in range(n) if i != rank) * row
        return sent, emulated, received, emulated
    if op == "broadcast":
        return (n - 1) / n * size, ring(n, size), (n - 1) / n * size, ring(n, size)
    if op == "send_recv":
        pos = kw["pos"]
        return (size if pos == kw["src"] else 0), ring(n, size), (size if pos == kw["dst"] else 0), ring(n, size)
    if op == "copy_to_region":
        return 0, 0, ring(n, size), ring(n, size)
    if op == "reduce_from_region":
        return ring(n, size), ring(n, size), 0, 0
    if op == "scatter_to_region":
        return 0, 0, (n - 1) / n * size, ring(n, size)
    if op == "gather_from_region":
        return (n - 1) * size, ring(n, n * size), 0, 0
    raise ValueError(op)


@pytest.mark.distributed
def test_byte_ledger_matches_formulas(comm_job):
    """PyNative execution books every op, forward and backward; jitted graphs book nothing (no side
    effects in graphs: see moetrain/dist/comm.py)."""
    _, reports = comm_job
    mode = "pynative"
    for report in reports:
        assert report["jit_ledger"] == {"native": {}, "emulated": {}, "native_forward": {}}
    for r, report in enumerate(reports):
        totals = {}
        for name, op, kind, shape_of, kw in CASES:
            ranks = group_ranks(kind, r)
            size = 4 * int(np.prod(shape_of(r)))
            traffic = expected_traffic(op, len(ranks), size, {**kw, "pos": ranks.index(r)}, r)
            bucket = totals.setdefault(kind, np.zeros(4))
            bucket += traffic
        ledger = report[f"{mode}_ledger"]
        assert ledger["native"] == {k: round(v[0] + v[2]) for k, v in totals.items()}, f"rank {r}"
        assert ledger["emulated"] == {k: round(v[1] + v[3]) for k, v in totals.items()}, f"rank {r}"
        assert ledger["native_forward"] == {k: round(v[0]) for k, v in totals.items() if v[0]}, f"rank {r}"


@pytest.mark.distributed
def test_ledger_counts_every_executed_call(comm_job):
    arrays, reports = comm_job
    size = 5 * 7 * 4
    for r, report in enumerate(reports):
        # three chained all_reduces on a 2-rank group (x <- all_reduce(x) * 0.5), forward columns
        assert report["loop_pynative_ledger"] == {"tp": round(3 * ring(2, size))}
        assert report["loop_jit_ledger"] == {}
        tp_sum = sum(i + 1.0 for i in group_ranks("tp", r))
        for mode in ("pynative", "jit"):
            np.testing.assert_allclose(arrays[r][f"loop_{mode}/y"], np.full((5, 7), tp_sum * 0.5, np.float32))


# ---------------------------------------------------------------------------------------------
# single process: no msrun needed
# ---------------------------------------------------------------------------------------------
def test_ops_on_a_trivial_group_are_the_identity():
    import mindspore as ms

    from moetrain.dist import comm
    from moetrain.dist.topology import ParallelContext

    ctx = ParallelContext.single()
    x = ms.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    g = ctx.group("tp")
    for out in (comm.all_reduce(x, g), comm.all_gather(x, g), comm.reduce_scatter(x, g), comm.all_to_all(x, g),
                comm.all_to_all_v(x, [2], [2], g), comm.broadcast(x, 0, g),
                comm.copy_to_region(x, g), comm.reduce_from_region(x, g), comm.scatter_to_region(x, g),
                comm.gather_from_region(x, g), comm.reduce_scatter_to_sequence(x, g),
                comm.gather_from_sequence(x, g)):
        assert out is x
    comm.barrier()   # no communicator: returns at once


def _fake_pair():
    from moetrain.dist.topology import Group

    return Group("ep", (0, 1), 0, "moe_g0_1")


@pytest.mark.parametrize("call, message", [
    (lambda comm, x, g: comm.reduce_scatter(x, g, axis=1),
     "dimension 1 of shape (2, 3) is not divisible by the 2 ranks"),
    (lambda comm, x, g: comm.all_to_all(x, g, split_axis=1), "dimension 1 of shape (2, 3) is not divisible"),
    (lambda comm, x, g: comm.all_gather(x, g, axis=2), "axis 2 is out of range for a tensor of shape (2, 3)"),
    (lambda comm, x, g: comm.all_to_all_v(x, [1, 0], [1, 3], g), "send_counts (1, 0) sum to 1 but x has 2 rows"),
    (lambda comm, x, g: comm.all_to_all_v(x, [1, 1], [2, 1], g), "sends 1 rows to itself but expects 2"),
    (lambda comm, x, g: comm.all_to_all_v(x, [1, 1, 0], [1, 1, 0], g), "need 2 send and 2 recv counts"),
    (lambda comm, x, g: comm.all_to_all_v(x, [1, 1], [1, 3], g, max_count=2), "max_count=2 is below"),
    (lambda comm, x, g: comm.broadcast(x, 2, g), "source rank 2 is not a rank of the ep group (0, 1)"),
])
def test_bad_arguments_are_refused_with_the_numbers(call, message):
    import mindspore as ms

    from moetrain.dist import comm

    x = ms.Tensor(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(comm, x, _fake_pair())
