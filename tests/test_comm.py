"""moetrain.distributed.comm on every backend, in one 4-rank msrun launch (tests/workers/comm_worker.py):
every op and its gradient against numpy (PyNative and ms.jit, world and 2-rank sub-groups) on the
emulation, on the Ascend native path and on the GPU native path (both through the contract
backend); byte ledgers against an independent count of the buffers that entered the primitives;
PairLink's exchanges; mutated native call sites that the contract must catch. Then single-process
checks: trivial groups, argument errors, the contract's local checks."""
import numpy as np
import pytest

from distributed import run_workers
from workers.comm_cases import (CASES, DYNAMIC_CASES, EXACT_TOKENS, LINK_EXCHANGES, MUTATIONS, PHASES,
                                WORLD, case_input, exact_inputs, exact_weights, group_ranks, link_payload,
                                loss_weight, phase_cases, position)
from workers.comm_recorder import emulated_bytes, native_bytes

REGION_OPS = {"copy_to_region", "reduce_from_region", "scatter_to_region", "gather_from_region"}
PHASE_MODES = [(label, mode) for label, _, _, modes in PHASES for mode in modes]
RUNS = [(label, mode, case) for label, mode in PHASE_MODES for case in phase_cases(label)]
CONTRACT_PHASES = [label for label, backend, _, _ in PHASES if backend == "contract"]


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
            counts, parts = kw["counts"], []
            for src, x in enumerate(members):
                start = sum(counts[src][:pos])
                parts.append(x[start:start + counts[src][pos]])
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
    if kw.get("stop_gradient"):
        return {r: np.zeros_like(xs[r]) for r in range(WORLD)}
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
# Bytes from the recorded primitive calls: textbook algorithms, written here independently of
# moetrain (n ranks, S bytes entering the primitive on this rank)
# ---------------------------------------------------------------------------------------------
def bytes_by_kind(calls, source, kinds, count, fixed_kind=None):
    totals = {}
    for call in calls:
        if call["source"] == source:
            kind = fixed_kind or kinds[call["group"]]
            totals[kind] = totals.get(kind, 0.0) + count(call)
    return {kind: round(v) for kind, v in totals.items() if round(v)}


# ---------------------------------------------------------------------------------------------
# one 4-rank job for the whole module
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def comm_job(tmp_path_factory):
    run = run_workers("tests/workers/comm_worker.py", nproc=4, timeout=400,
                      job_dir=str(tmp_path_factory.mktemp("comm_job"))).check()
    assert not run.leftovers, f"processes survived the job: {run.leftovers}"
    return run.npz_results(), run.json_results()


@pytest.mark.distributed
@pytest.mark.parametrize("phase, mode, case", RUNS, ids=[f"{p}-{m}-{c[0]}" for p, m, c in RUNS])
def test_op_and_gradient_match_numpy(comm_job, phase, mode, case):
    arrays, reports = comm_job
    name, op, kind, shape_of, kw = case
    xs, ys, ws = case_arrays(name, shape_of, op, kind, kw)
    grads = reference_grads(op, kind, kw, xs, ws)
    for r in range(WORLD):
        got_y, got_dx = arrays[r][f"{phase}/{mode}/{name}/y"], arrays[r][f"{phase}/{mode}/{name}/dx"]
        assert got_y.shape == ys[r].shape, f"rank {r}: output shape {got_y.shape} != {ys[r].shape}"
        np.testing.assert_allclose(got_y, ys[r], rtol=1e-6, atol=1e-6, err_msg=f"{name} {phase} {mode} rank {r}")
        np.testing.assert_allclose(got_dx, grads[r], rtol=1e-5, atol=1e-5, err_msg=f"{name} {phase} {mode} rank {r}")


@pytest.mark.distributed
def test_phases_ran_the_backends_they_name(comm_job):
    _, reports = comm_job
    for label, backend, target, _ in PHASES:
        assert reports[0]["phases"][label]["backend"] == backend
        assert reports[0]["phases"][label]["target"] == target


@pytest.mark.distributed
@pytest.mark.parametrize("phase, mode", PHASE_MODES, ids=[f"{p}-{m}" for p, m in PHASE_MODES])
def test_data_movement_is_bit_exact(comm_job, phase, mode):
    """Gathers, all-to-alls and broadcasts add exact zeros (emulation and contract): bitwise equal."""
    arrays, _ = comm_job
    for name, op, kind, shape_of, kw in phase_cases(phase):
        if op in ("all_gather", "all_to_all", "all_to_all_v", "broadcast", "gather_from_region"):
            xs, ys, _ = case_arrays(name, shape_of, op, kind, kw)
            for r in range(WORLD):
                np.testing.assert_array_equal(arrays[r][f"{phase}/{mode}/{name}/y"], ys[r], err_msg=f"{name} rank {r}")


@pytest.mark.distributed
def test_inf_stays_in_its_slot(comm_job):
    arrays, _ = comm_job
    expected = np.concatenate([np.zeros((2, 2), np.float32) + r for r in range(WORLD)])
    expected[2, 0] = np.inf
    for r in range(WORLD):
        np.testing.assert_array_equal(arrays[r]["inf/y"], expected)


@pytest.mark.distributed
@pytest.mark.parametrize("phase", CONTRACT_PHASES)
def test_int32_travels_exactly_on_the_native_path(comm_job, phase):
    arrays, _ = comm_job
    xs = [(np.arange(8, dtype=np.int64).reshape(4, 2) * 70001 - 3 * 10 ** 7 * r).astype(np.int32) for r in range(WORLD)]
    for r in range(WORLD):
        got = arrays[r][f"{phase}/int32/y"]
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.stack([x[r] for x in xs]))


# ---------------------------------------------------------------------------------------------
# byte ledgers against the primitive calls recorded on each rank
# ---------------------------------------------------------------------------------------------
def _ledgers(report, phase):
    return report["phases"][phase]["ledgers"]


def _split(calls):
    """The calls of the forward, and of forward and backward (the worker marks where the forward ends)."""
    return (("forward", [c for c in calls if not c["backward"]]), ("all", calls))


@pytest.mark.distributed
@pytest.mark.parametrize("phase", CONTRACT_PHASES)
def test_native_column_counts_what_entered_the_native_primitives(comm_job, phase):
    """The native path's primitives were called (contract stand-ins, recorded with the shapes that
    entered them): the ledger's native column, forward and forward+backward, is their traffic."""
    _, reports = comm_job
    for r, report in enumerate(reports):
        kinds = report["group_kinds"]
        for name, entry in _ledgers(report, phase).items():
            assert any(c["source"] == "contract" for c in entry["calls"]), f"{phase} {name}: no native primitive ran"
            for part, calls in _split(entry["calls"]):
                expected = bytes_by_kind(calls, "contract", kinds, native_bytes)
                assert entry[part]["native"] == expected, f"{phase} {name} {part} rank {r}"


@pytest.mark.distributed
def test_emulated_column_counts_what_the_allreduces_moved(comm_job):
    _, reports = comm_job
    for r, report in enumerate(reports):
        kinds = report["group_kinds"]
        for name, entry in _ledgers(report, "emulated").items():
            assert all(call["source"] == "mindspore" for call in entry["calls"]), "emulation called a native primitive"
            for part, calls in _split(entry["calls"]):
                assert entry[part]["emulated"] == bytes_by_kind(calls, "mindspore", kinds, emulated_bytes), \
                    f"emulated {name} {part} rank {r}"


@pytest.mark.distributed
def test_ledger_describes_the_same_traffic_on_every_backend(comm_job):
    """Both columns are booked whichever backend runs: the emulation's run books the Ascend path's
    native bytes (checked against real calls in the contract run) and vice versa."""
    _, reports = comm_job
    for r, report in enumerate(reports):
        emulated, ascend, gpu = (_ledgers(report, p) for p in ("emulated", "contract", "contract_gpu"))
        assert set(emulated) == set(ascend) == {case[0] for case in CASES}
        for name in emulated:
            for part in ("forward", "all"):
                assert emulated[name][part] == ascend[name][part], f"{name} {part} rank {r}"
        for name in gpu:
            assert gpu[name]["all"]["emulated"] == emulated[name]["all"]["emulated"], f"{name} rank {r}"


@pytest.mark.distributed
def test_no_backward_bytes_without_a_gradient(comm_job):
    _, reports = comm_job
    for report in reports:
        for phase in ("emulated", "contract"):
            entry = _ledgers(report, phase)["all_to_all@world_no_grad"]
            assert entry["all"] == entry["forward"] and entry["forward"]["native"]
            assert not any(call["backward"] for call in entry["calls"])
            entry = _ledgers(report, phase)["all_to_all@world"]
            assert entry["all"]["native"]["world"] == 2 * entry["forward"]["native"]["world"]
            assert any(call["backward"] for call in entry["calls"])


@pytest.mark.distributed
def test_gpu_path_books_the_padded_gathers(comm_job):
    """On GPU all_to_all(_v) gather whole outboxes (AlltoAll is Ascend-only): more bytes than Ascend's."""
    _, reports = comm_job
    for report in reports:
        for name in ("all_to_all@world", "all_to_all_v@world"):
            ascend = _ledgers(report, "contract")[name]["forward"]["native"]["world"]
            gpu = _ledgers(report, "contract_gpu")[name]["forward"]["native"]["world"]
            assert gpu > ascend, name
            assert {c["prim"] for c in _ledgers(report, "contract_gpu")[name]["calls"]
                    if c["source"] == "contract"} == {"AllGather"}


@pytest.mark.distributed
def test_jitted_graphs_book_nothing_pynative_books_every_call(comm_job):
    arrays, reports = comm_job
    size = 5 * 7 * 4
    for r, report in enumerate(reports):
        for label, _, _, modes in PHASES:
            if "jit" in modes:
                assert report["phases"][label]["jit_ledger"] == {"native": {}, "emulated": {}}
        phase = report["phases"]["emulated"]
        # three chained all_reduces on a 2-rank group (x <- all_reduce(x) * 0.5)
        assert phase["loop_pynative_ledger"] == {"tp": round(3 * 2 * (2 - 1) / 2 * size)}
        assert phase["loop_jit_ledger"] == {}
        tp_sum = sum(i + 1.0 for i in group_ranks("tp", r))
        for mode in ("pynative", "jit"):
            np.testing.assert_allclose(arrays[r][f"loop_{mode}/y"], np.full((5, 7), tp_sum * 0.5, np.float32))


# ---------------------------------------------------------------------------------------------
# PairLink: the pipeline's point-to-point
# ---------------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize("phase", ["emulated", "contract"])
def test_pair_link_delivers_exactly_and_books_its_bytes(comm_job, phase):
    arrays, reports = comm_job
    source, count = ("mindspore", emulated_bytes) if phase == "emulated" else ("contract", native_bytes)
    column = "emulated" if phase == "emulated" else "native"
    for r, report in enumerate(reports):
        lower = position("tp", r) == 0
        peer = group_ranks("tp", r)[1 if lower else 0]
        for name, lower_sends, upper_sends in LINK_EXCHANGES:
            receives = upper_sends if lower else lower_sends
            got = arrays[r][f"{phase}/link/{name}"]
            if receives:
                np.testing.assert_array_equal(got, link_payload(name, peer), err_msg=f"{phase} {name} rank {r}")
            else:
                assert got.size == 0
            entry = report["phases"][phase]["links"][name]
            expected = bytes_by_kind(entry["calls"], source, report["group_kinds"], count, fixed_kind="pp")
            assert entry["ledger"][column] == expected, f"{phase} {name} rank {r}"
            if phase == "contract":   # the emulation's run booked the native bytes of the same exchange
                assert entry["ledger"] == reports[r]["phases"]["emulated"]["links"][name]["ledger"]
                prims = sorted(c["prim"] for c in entry["calls"] if c["source"] == "contract")
                sends = lower_sends if lower else upper_sends
                assert prims == sorted((["Send"] if sends else []) + (["Receive"] if receives else []))


# ---------------------------------------------------------------------------------------------
# The contract bites: mutated native call sites fail (an error on the ranks named, or values
# that differ from numpy there)
# ---------------------------------------------------------------------------------------------
EXPECTED_FAILURES = {
    "alltoall_axes_swapped": ([0, 1, 2, 3], "is not divisible by split_count 4"),
    "broadcast_global_root": ([1, 3], None),           # group {1, 3}: global root 1 is in-group rank 1 = rank 3
    "allgather_wrong_group": ([0, 1, 2, 3], None),      # gathers the world instead of the tp pair
    "alltoallv_recv_reversed": ([0, 1, 2, 3], "counts disagree"),
    "alltoall_on_gpu": ([0, 1, 2, 3], "ops.AlltoAll is documented for Ascend only"),
    "receive_wrong_shape": ([0, 1, 2, 3], "but Receive declared"),
    "send_recv_tag_mismatch": ([0, 1, 2, 3], "does not match"),
    "both_stages_send_first": ([0, 1, 2, 3], "a Send must meet a Receive"),
    "alltoallv_tensor_lists_swapped": ([0, 1, 2, 3], "elements, but the input has"),
    "alltoallv_tensor_block_size": ([0, 1, 2, 3], "elements, but the input has"),
    "alltoallv_empty_reshaped": ([1, 3], None),         # they receive nothing: AlltoAllV's () output
}


@pytest.mark.distributed
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_mutated_native_call_site_fails(comm_job, mutation):
    arrays, reports = comm_job
    failing, message = EXPECTED_FAILURES[mutation]
    target = MUTATIONS[mutation]
    case = next((c for c in CASES if c[0] == target), None)
    if case is not None:
        name, op, kind, shape_of, kw = case
        _, ys, _ = case_arrays(name, shape_of, op, kind, kw)
    for r, report in enumerate(reports):
        error = report["mutations"][mutation]["error"]
        key = f"mutation/{mutation}/y"
        if r not in failing:   # the rest of the job is right
            assert error is None, f"{mutation} rank {r}: {error}"
            np.testing.assert_array_equal(arrays[r][key], ys[r])
            continue
        if message is not None:
            assert error is not None and message in error, f"{mutation} rank {r}: {error}"
        elif error is None:
            got = arrays[r][key]
            assert got.shape != ys[r].shape or not np.array_equal(got, ys[r]), f"{mutation} rank {r} went unnoticed"


# ---------------------------------------------------------------------------------------------
# all_to_all_v_dynamic (Tensor counts) and the exact-split dispatcher it carries (contract, Ascend)
# ---------------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize("name", DYNAMIC_CASES)
def test_dynamic_all_to_all_v_moves_exactly_the_counted_rows(comm_job, name):
    """Values bitwise, gradients against numpy, a zero spare row out whose gradient (loss weight
    SPARE_WEIGHT) does not leak into dx, and the ledger equal to the AlltoAllV calls that ran (one
    per direction, block_size = one row, exactly the counted elements in)."""
    arrays, reports = comm_job
    _, op, kind, shape_of, kw = next(c for c in CASES if c[0] == name)
    xs, ys, ws = case_arrays(name, shape_of, op, kind, kw)
    grads = reference_grads(op, kind, kw, xs, ws)
    for r, report in enumerate(reports):
        y, dx = arrays[r][f"contract/dynamic/{name}/y"], arrays[r][f"contract/dynamic/{name}/dx"]
        np.testing.assert_array_equal(y[:-1], ys[r], err_msg=f"{name} rank {r}")
        np.testing.assert_array_equal(y[-1], 0.0)
        np.testing.assert_allclose(dx[:-1], grads[r], rtol=1e-6, atol=1e-6, err_msg=f"{name} rank {r}")
        np.testing.assert_array_equal(dx[-1], 0.0)
        entry = report["phases"]["contract"]["dynamic"][name]
        moved = [c for c in entry["calls"] if c["source"] == "contract"]
        assert [(c["prim"], c["block_size"], c["backward"]) for c in moved] == [("AlltoAllV", 2, False),
                                                                              ("AlltoAllV", 2, True)]
        assert moved[0]["tensors"][0]["shape"] == [2 * xs[r].shape[0]], f"{name} rank {r}"
        for part, calls in _split(entry["calls"]):
            expected = bytes_by_kind(calls, "contract", report["group_kinds"], native_bytes)
            assert entry[part]["native"] == expected, f"{name} {part} rank {r}"


def _swiglu_expert(weights, e, x, grad_out):
    """One expert's output for rows x and the gradient of <grad_out, output> with respect to x."""
    w_gate, w_up, w_down = (w[e].astype(np.float64) for w in weights)
    a, b = x @ w_gate, x @ w_up
    s = 1 / (1 + np.exp(-a))
    out = (a * s * b) @ w_down
    dh = grad_out @ w_down.T
    da, db = dh * b * s * (1 + a * (1 - s)), dh * a * s
    return out, da @ w_gate.T + db @ w_up.T


@pytest.mark.distributed
def test_exact_dispatch_with_every_token_on_one_rank_stays_exact(comm_job):
    """Every token of both ranks of each tp pair routed to experts (0, 1), both on position 0: the
    exact-split dispatcher (Ascend path: counts, AlltoAllV with Tensor counts, grouped matmul over
    the received group list) gives the numpy loop's output and gradients; position 0's experts
    compute exactly the 2 T k routed rows, position 1's none (it receives nothing: AlltoAllV's
    shape-() output), and no capacity is left to size."""
    arrays, reports = comm_job
    weights = exact_weights()
    for r, report in enumerate(reports):
        x, idx, weight, cot = exact_inputs(r)
        y, dx, dweight = np.zeros_like(x, np.float64), np.zeros_like(x, np.float64), np.zeros_like(weight, np.float64)
        for t in range(EXACT_TOKENS):
            for j, e in enumerate(idx[t]):
                out, grad_x = _swiglu_expert(weights, e, x[t:t + 1].astype(np.float64), weight[t, j] * cot[t:t + 1])
                y[t] += weight[t, j] * out[0]
                dx[t] += grad_x[0]
                dweight[t, j] = float(out[0] @ cot[t])
        for key, expected in (("y", y), ("dx", dx), ("dweight", dweight)):
            np.testing.assert_allclose(arrays[r][f"exact/{key}"], expected, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{key} rank {r}")
        first = position("tp", r) == 0
        routed_here = 2 * EXACT_TOKENS * 2 if first else 0          # both ranks' T k assignments
        assert float(arrays[r]["exact/expert_rows"]) == routed_here, r
        np.testing.assert_array_equal(arrays[r]["exact/group_sizes"], [EXACT_TOKENS * 2, EXACT_TOKENS * 2]
                                      if first else [0, 0])
        exact = report["phases"]["contract"]["exact"]
        assert (exact["splits"], exact["capacity_fields"], exact["compute"]) == ("exact", [], "gmm"), exact
        dispatches = [c for c in exact["calls"] if c["prim"] == "AlltoAllV"]
        assert dispatches[0]["send"] == [2 * EXACT_TOKENS, 0], (r, dispatches[0])   # all of T k to position 0


# ---------------------------------------------------------------------------------------------
# single process: no msrun needed
# ---------------------------------------------------------------------------------------------
def test_ops_on_a_trivial_group_are_the_identity():
    import mindspore as ms

    from moetrain.distributed import comm
    from moetrain.distributed.topology import ParallelContext

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
    from moetrain.distributed.topology import Group

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

    from moetrain.distributed import comm

    x = ms.Tensor(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(comm, x, _fake_pair())


def test_backend_and_target_are_checked(monkeypatch):
    from moetrain.distributed import comm
    from moetrain.testing import contract

    monkeypatch.setenv("MOETRAIN_COMM_BACKEND", "nccl")
    with pytest.raises(ValueError, match="use auto, emulated, native, contract"):
        comm.backend_name()
    monkeypatch.setenv("MOETRAIN_COMM_BACKEND", "contract")
    monkeypatch.setenv("MOETRAIN_CONTRACT_TARGET", "GPU")
    assert comm.primitives() is contract and comm.native_target() == "GPU"
    with pytest.raises(contract.ContractError, match="ops.AlltoAll is documented for Ascend only"):
        contract.AlltoAll(2, 0, 0, "any")
    monkeypatch.setenv("MOETRAIN_CONTRACT_TARGET", "CPU")
    with pytest.raises(ValueError, match="MOETRAIN_CONTRACT_TARGET='CPU'"):
        contract.target()


@pytest.mark.parametrize("op, shape, dtype, params, error, message", [
    ("AllGather", (2, 3), "float32", (), None, None),
    ("AllGather", (2, 3), "float64", (), TypeError, "dtype Float64 is not accepted on Ascend"),
    ("AllReduce", (2, 3), "int64", ("sum",), NotImplementedError, "no exact CPU reference for dtype Int64"),
    ("ReduceScatter", (3, 2), "float32", (), ValueError, "first dimension of shape (3, 2) must be divisible by"),
    ("AlltoAll", (4, 2), "float32", (3, 0, 1), ValueError, "split_count 3 != group size 2"),
    ("AlltoAll", (3, 2), "float32", (2, 0, 1), ValueError, "dimension 0 of shape (3, 2) is not divisible"),
    ("AlltoAll", (4, 2), "float32", (2, 2, 0), ValueError, "dimension 2 is out of range"),
    ("AlltoAllV", (2, 3), "float32", (1, (3, 3), (3, 3)), ValueError, "must be flattened to 1-D"),
    ("AlltoAllV", (5,), "float32", (1, (3, 3), (3, 3)), ValueError, "= 6 elements, but the input has 5"),
    ("AlltoAllV", (6,), "float32", (1, (3, 3, 0), (3, 3)), ValueError, "must hold 2 non-negative ints"),
    ("Broadcast", (2, 3), "float32", (2,), ValueError, "root_rank 2 is not a rank of the group (0..1, ranks IN"),
])
def test_contract_checks_each_call_locally(op, shape, dtype, params, error, message):
    """What the stand-ins refuse before any communication (also at ms.jit compile time)."""
    import mindspore as ms

    from moetrain.testing import contract

    contract.register_group("contract_test_pair", (0, 1))
    dtype = getattr(ms, dtype)
    if error is None:
        contract._validated(op, "contract_test_pair", shape, dtype, params)
        return
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        contract._validated(op, "contract_test_pair", shape, dtype, params)
    with pytest.raises(contract.ContractError, match="communicator 'no_such_group' does not exist"):
        contract._validated(op, "no_such_group", shape, dtype, params)
