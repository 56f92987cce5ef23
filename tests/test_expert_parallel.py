"""Expert parallelism against independent references.

* Dispatchers (4 msrun ranks, tests/workers/ep_layer_worker.py): outputs, gradients (tokens,
  combine weights, this rank's expert slices), loads, drops and rows computed of both dispatchers,
  ep=2 and ep=4, dropless and capacity, random, skewed and one-sided routing, against a float64
  numpy loop over each token's experts with a hand-written backward; on the CPU path (grouped GEMM
  rows and batched-matmul capacity layouts), the Ascend path (contracts of moe_token_permute /
  unpermute / grouped_matmul_v4) and the GPU path (allgather), dropless buffers sized exactly to the
  routing ("tight") or at the bound.
* Bytes: the "ep" ledger of each PyNative call against the buffers that entered MindSpore's
  AllReduce (recorded in the worker) and against the volumes the dispatcher spec implies for
  capacities computed here from the routing.
* 'global' aux-loss scope: value and router gradient on dp ranks against numpy over the whole batch.
* Training (tests/workers/ep_train_worker.py): dp4 with ep4 / ep2, both dispatchers, dropless and
  capacity, against one process training the same global batches: loss, grad_norm, loads, and the
  rows the experts computed against the routed rows.
* Single process: the dispatchers on a one-rank group equal `SortDispatcher` (PyNative and jit),
  expert slicing, the 'sequence' scope, gradient groups, error messages.
"""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from distributed import REPO, launch_after_shared_jobs, new_job_dir, run_workers
from workers import ep_cases as C


@pytest.fixture(scope="module")
def ms():
    import mindspore

    mindspore.set_context(device_target="CPU")
    return mindspore


# ---------------------------------------------------------------------------------------------
# numpy reference: one ep group's ranks, every assignment computed by a naive loop
# ---------------------------------------------------------------------------------------------
def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def kept_assignments(idx, capacity_factor):
    """[T, k] bool: capacity keeps each expert's first C assignments in order t*k+j (all if 0)."""
    if capacity_factor == 0:
        return np.ones(idx.shape, bool)
    tokens, top_k = idx.shape
    capacity = max(1, min(math.ceil(capacity_factor * tokens * top_k / C.EXPERTS), tokens))
    seen = np.zeros(C.EXPERTS, int)
    kept = np.zeros(idx.shape, bool)
    for t in range(tokens):
        for j in range(top_k):
            kept[t, j] = seen[idx[t, j]] < capacity
            seen[idx[t, j]] += 1
    return kept


def reference_group(data, ranks, routing_kind, capacity_factor):
    """Per rank of one ep group: y, dx, dweight, the full expert gradients (summed over the
    group's tokens), loads, drops, the assignments each rank sends to every rank of the group
    ("to"), and the rows each of its experts receives ("received_per_expert")."""
    w_gate, w_up, w_down = (w.astype(np.float64) for w in C.expert_weights())
    ep = len(ranks)
    local = C.EXPERTS // ep
    grads = {"dw_gate": np.zeros_like(w_gate), "dw_up": np.zeros_like(w_up), "dw_down": np.zeros_like(w_down)}
    out = {}
    to = {rank: np.zeros(ep, int) for rank in ranks}
    per_expert = np.zeros(C.EXPERTS, int)
    for position, rank in enumerate(ranks):
        x = C.tokens(data, rank).astype(np.float64)
        cot = C.cotangent(data, rank).astype(np.float64)
        idx, weight = C.routing(routing_kind, rank)
        weight = weight.astype(np.float64)
        kept = kept_assignments(idx, capacity_factor)
        y, dx, dweight = np.zeros_like(x), np.zeros_like(x), np.zeros_like(weight)
        for t in range(x.shape[0]):
            for j in range(idx.shape[1]):
                if not kept[t, j]:
                    continue
                e = idx[t, j]
                to[rank][e // local] += 1
                per_expert[e] += 1
                a, b = x[t] @ w_gate[e], x[t] @ w_up[e]
                h = a * sigmoid(a) * b
                expert_out = h @ w_down[e]
                y[t] += weight[t, j] * expert_out
                dweight[t, j] = cot[t] @ expert_out
                d_out = weight[t, j] * cot[t]
                grads["dw_down"][e] += np.outer(h, d_out)
                dh = w_down[e] @ d_out
                da = dh * b * sigmoid(a) * (1 + a * (1 - sigmoid(a)))
                db = dh * a * sigmoid(a)
                grads["dw_gate"][e] += np.outer(x[t], da)
                grads["dw_up"][e] += np.outer(x[t], db)
                dx[t] += w_gate[e] @ da + w_up[e] @ db
        out[rank] = {"y": y, "dx": dx, "dweight": dweight,
                     "load": np.bincount(idx.reshape(-1), minlength=C.EXPERTS).astype(np.float64),
                     "dropped": float((~kept).sum())}
    for position, rank in enumerate(ranks):
        for key, full in grads.items():
            out[rank][key] = full[position * local:(position + 1) * local]
        out[rank]["to"] = to[rank]
        out[rank]["rank"] = rank
        out[rank]["sent"] = int(to[rank].sum() - to[rank][position])
        out[rank]["received"] = int(sum(to[r][position] for r in ranks) - to[rank][position])
        out[rank]["routed_here"] = int(per_expert[position * local:(position + 1) * local].sum())
        out[rank]["received_per_expert"] = per_expert[position * local:(position + 1) * local]
    return out


def group_refs(case):
    """{rank: reference} for every rank of the world under `case`."""
    refs = {}
    for base in range(0, C.WORLD, case.ep):
        refs.update(reference_group(case.data, C.ep_group_of(base, case.ep), case.routing, case.capacity_factor))
    return refs


def capacities_from_routing(case, refs):
    """The dropless buffer sizes of the case, computed here from the numpy routing, per ep group:
    per destination rank, the most rows one source sends it (tight) or the bound T min(k, L); per
    local expert, the most rows it receives (tight) or ep T."""
    local = C.EXPERTS // case.ep
    out = {}
    for base in range(0, C.WORLD, case.ep):
        ranks = C.ep_group_of(base, case.ep)
        if case.capacity == "tight":
            pair = [max(1, *(int(refs[r]["to"][d]) for r in ranks)) for d in range(case.ep)]   # runs >= 1 row
            expert = max(int(refs[r]["received_per_expert"].max()) for r in ranks)
        else:
            pair, expert = [C.TOKENS * min(C.TOP_K, local)] * case.ep, case.ep * C.TOKENS
        for r in ranks:
            out[r] = {"pair": pair, "expert": expert}
    return out


def expected_expert_rows(case, ref, capacity):
    """Rows this rank's expert GEMMs compute: exactly the routed rows on the rows layout, the whole
    buffer on a capacity layout."""
    local = C.EXPERTS // case.ep
    if case.capacity_factor:
        cap = max(1, min(math.ceil(case.capacity_factor * C.TOKENS * C.TOP_K / C.EXPERTS), C.TOKENS))
        return local * case.ep * cap
    if case.compute == "bmm" or case.path == "gpu":   # capped by what can arrive: ep x min(T, C_me) rows
        me = C.ep_group_of(ref["rank"], case.ep).index(ref["rank"])
        arriving = C.TOKENS if case.dispatcher == "allgather" or case.path == "gpu" else capacity["pair"][me]
        return local * min(capacity["expert"], case.ep * min(C.TOKENS, arriving))
    return ref["routed_here"]


def launch_ep_job(session, job_dirs):
    """One 4-rank msrun job: the dispatcher cases, then, when the training tests are selected, the
    dp4 training runs (one launch instead of two), with their one-process references in a process
    beside it. Launched in the background when the suite's shared jobs end (tests/distributed.py:
    DeferredLaunch), beside the files that launch jobs of their own. The first dispatch capacities
    of the training runs are 4 times the even share (the bound), so the first sizing shrinks them,
    and the routing's drift later overflows and re-runs a call (both checked).
    Returns (the job, (the references' process, its log, its folder) or None)."""
    training_selected = any("training" in getattr(item, "fixturenames", ()) for item in session.items)
    runs = [f"{name}:{TINY_MOE},parallel.data_parallel=4,{overrides}" for name, (_, overrides) in EP_RUNS.items()]
    runs.append(UNDERSIZED)
    references = None
    if training_selected:
        out = tempfile.mkdtemp(prefix="moetrain-ep-train-reference-")
        job_dirs.append(out)
        log = open(os.path.join(out, "reference.log"), "w+")     # a file: a pipe could fill and stall it
        references = subprocess.Popen([sys.executable, WORKER, out, CONFIG,
                                       *(f"{name}:{overrides}" for name, overrides in REFERENCES.items())],
                                      cwd=out, stdout=log,
                                      stderr=subprocess.STDOUT), log, out
    job_dir = new_job_dir()
    job_dirs.append(job_dir)
    try:
        job = run_workers("tests/workers/ep_layer_worker.py", nproc=C.WORLD, timeout=1800, job_dir=job_dir,
                          args=[CONFIG, *runs] if training_selected else [])
    except BaseException:
        stop_references(references)
        raise
    return job, references


def stop_references(references):
    if references is not None:
        proc, log, _ = references
        if proc.poll() is None:      # a failed launch: do not leave the references behind
            proc.kill()
            proc.wait()
        log.close()


EP_LAUNCH = launch_after_shared_jobs(__name__, launch_ep_job, fixture="ep_job")


@pytest.fixture(scope="module")
def ep_job(request):
    """(the 4-rank job, the references' process or None): see launch_ep_job."""
    job, references = EP_LAUNCH.join(request.session)
    try:
        yield job.check(), references
    finally:
        stop_references(references)
        if references is not None:
            shutil.rmtree(references[2], ignore_errors=True)


@pytest.fixture(scope="module")
def layer_run(ep_job):
    job, _ = ep_job
    return job.npz_results(), job.json_results()


def skip_unless_run_here(*names):
    """The worker runs ep=2 cases only where MindSpore has AllReduce in CPU sub-groups (not 2.7:
    moetrain/compat.py); the ep=4 cases (groups = the world) run on every supported version."""
    if not C.runs_here(*names):
        from moetrain import compat

        pytest.skip(f"ep=2 needs CPU sub-group collectives, which MindSpore {compat.mindspore_version_string()} lacks")


def case_arrays(arrays, name, rank):
    return {key.split("/")[-1]: value for key, value in arrays[rank].items() if key.startswith(name + "/")}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(C.CASES))
def test_dispatcher_matches_numpy_loop(layer_run, name):
    skip_unless_run_here(name)
    arrays, reports = layer_run
    case = C.CASES[name]
    refs = group_refs(case)
    capacity = capacities_from_routing(case, refs)
    for rank, ref in refs.items():
        got = case_arrays(arrays, name, rank)
        for key in ("y", "dx", "dweight", "dw_gate", "dw_up", "dw_down"):
            np.testing.assert_allclose(got[key], ref[key], rtol=2e-5, atol=2e-5, err_msg=f"{name} rank {rank} {key}")
        np.testing.assert_array_equal(got["load"], ref["load"])
        assert float(got["dropped"]) == ref["dropped"], f"{name} rank {rank}"
        assert float(got["expert_rows"]) == expected_expert_rows(case, ref, capacity[rank]), f"{name} rank {rank}"
        got_capacity = reports[rank][name]["capacity"]
        if case.capacity == "tight" and not case.capacity_factor:   # sized as computed here
            want = {"pair_capacity": list(capacity[rank]["pair"]), "expert_capacity": capacity[rank]["expert"]}
            assert got_capacity == {k: want[k] for k in got_capacity}, f"{name} rank {rank}: {got_capacity}"
        else:
            assert not any(got_capacity.values()), f"{name} rank {rank}: {got_capacity}"


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n, c in C.CASES.items() if c.path != "cpu"])
def test_ascend_and_gpu_paths_reproduce_the_cpu_path(layer_run, name):
    """Same data, same weights: the Ascend path (contract ops) and the GPU path (allgather + batched
    matmul) give the CPU path's outputs and gradients on every rank."""
    twin = C.cpu_twin(name)
    skip_unless_run_here(name, twin)
    arrays, reports = layer_run
    for rank in range(C.WORLD):
        got, want = case_arrays(arrays, name, rank), case_arrays(arrays, twin, rank)
        for key in ("y", "dx", "dweight", "dw_gate", "dw_up", "dw_down", "load"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5, err_msg=f"{name} vs {twin} {key}")
    case = C.CASES[name]
    if case.path == "gpu":          # no AlltoAll on GPU: alltoall runs as allgather there
        assert {r[name]["dispatcher"] for r in reports} == {"AllGatherDispatcher"}
    assert {r[name]["compute"] for r in reports} == {"gmm" if case.path == "ascend" else "bmm"}


def test_skewed_cases_really_skew_and_drop():
    """The skewed routing leaves rank 3 (expert 3, ep=4) without tokens and the capacity cases drop;
    "one" sends everything to experts 0 and 1."""
    ref = reference_group("alltoall-ep4-dropless-skewed", list(range(4)), "skewed", 0.0)
    assert sum(r["load"][3] for r in ref.values()) == 0
    assert all(r["load"][0] >= 11 for r in ref.values())
    assert ref[3]["received"] == 0 and ref[3]["routed_here"] == 0
    capped = reference_group("alltoall-ep2-cap-skewed", [0, 1], "skewed", C.CAPACITY_FACTOR)
    assert all(r["dropped"] > 0 for r in capped.values())
    one = reference_group("allgather-ep2-dropless-one", [0, 1], "one", 0.0)
    assert one[0]["routed_here"] == 2 * C.TOKENS * C.TOP_K and one[1]["routed_here"] == 0


# ---------------------------------------------------------------------------------------------
# Bytes: ledger against recorded buffers and against the dispatcher spec
# ---------------------------------------------------------------------------------------------
def ring(n, nbytes):
    return 2.0 * (n - 1) / n * nbytes


def spec_native_bytes(case, ref, capacity):
    """Native 'ep' bytes of one forward + backward on this rank (fp32 rows of HIDDEN), from what the
    dispatcher is specified to exchange."""
    n, row, local = case.ep, C.HIDDEN * 4, C.EXPERTS // case.ep
    if case.dispatcher == "allgather" or case.path == "gpu":  # gathers x and [T, 2k or 3k] routing; reduce-scatters [ep T, H]
        routing_cols = (3 if case.capacity_factor else 2) * C.TOP_K
        gathers = (n - 1) * C.TOKENS * (row + routing_cols * 4)
        return 2 * gathers + 2 * (n - 1) * C.TOKENS * row
    if case.capacity_factor:          # two fixed [E C, H] all-to-alls, forward and backward
        cap = max(1, min(math.ceil(case.capacity_factor * C.TOKENS * C.TOP_K / C.EXPERTS), C.TOKENS))
        return 4 * (n - 1) / n * C.EXPERTS * cap * row
    counts = (n - 1) / n * n * local * 4                      # the per-expert counts, forward only
    me = C.ep_group_of(ref["rank"], n).index(ref["rank"])
    to_others = sum(c for j, c in enumerate(capacity["pair"]) if j != me)
    from_others = (n - 1) * capacity["pair"][me]
    # dispatch sends C_j to each other j and gets C_me from each; combine the reverse; fwd + bwd each
    return counts + 2 * (to_others + from_others) * row


PYNATIVE = [n for n, c in C.CASES.items() if c.mode == "pynative"]


@pytest.mark.distributed
@pytest.mark.parametrize("name", PYNATIVE)
def test_ep_bytes_match_the_buffers_that_entered_the_collectives(layer_run, name):
    """Emulated column = the ring volume of the AllReduce inputs recorded at the primitive; native
    column = the spec's volume for capacities computed from the routing; the padded all-to-all
    buffers [ep, C, H] are among the recorded inputs (as [ep, ep, C, H] slot buffers)."""
    skip_unless_run_here(name)
    _, reports = layer_run
    case = C.CASES[name]
    refs = group_refs(case)
    capacity = capacities_from_routing(case, refs)
    for rank in range(C.WORLD):
        report = reports[rank][name]
        calls = report["allreduce_inputs"]
        assert calls and all(dtype == "Float32" for _, dtype in calls), f"{name} rank {rank}: {calls}"
        recorded = sum(ring(case.ep, int(np.prod(shape)) * 4) for shape, _ in calls)
        assert report["emulated"] == pytest.approx(recorded, abs=1), f"{name} rank {rank}"
        assert report["native"] == pytest.approx(spec_native_bytes(case, refs[rank], capacity[rank]), abs=1), \
            f"{name} rank {rank}: {report}"
        if case.dispatcher == "alltoall" and not case.capacity_factor and case.path != "gpu":
            token_buffer = case.ep * case.ep * max(capacity[rank]["pair"]) * C.HIDDEN   # [src, dst, max C_j, H]
            assert [int(np.prod(s)) for s, _ in calls].count(token_buffer) == 4, f"{name} rank {rank}: {calls}"


@pytest.mark.distributed
def test_jitted_calls_book_nothing(layer_run):
    """The ledger books on the host in PyNative only (comm module notes): a jitted call books 0."""
    _, reports = layer_run
    for name, case in C.CASES.items():
        if case.mode == "jit" and C.runs_here(name):
            assert all(r[name]["native"] == 0 and r[name]["emulated"] == 0 for r in reports), name


@pytest.mark.distributed
def test_dropless_alltoall_moves_rows_in_proportion_to_the_routing(layer_run):
    """Tight buffers: destination j gets the largest count any source sends it, so a rank sends
    sum_j C_j rows, within 1.3x of its T k routed rows under random routing, and under 3/4 of the
    bytes at the bound; with routing skewed to experts 0 and 1 (ep=4) the idle ranks get 1-row runs."""
    skip_unless_run_here("alltoall-ep2-dropless-random")
    _, reports = layer_run
    tight = C.CASES["alltoall-ep2-dropless-random"]
    refs = group_refs(tight)
    at_bound = capacities_from_routing(tight._replace(capacity="bound"), refs)
    for rank in range(C.WORLD):
        pair = reports[rank]["alltoall-ep2-dropless-random"]["capacity"]["pair_capacity"]
        assert sum(pair) <= 1.3 * C.TOKENS * C.TOP_K, (rank, pair)
        bound_bytes = spec_native_bytes(tight, refs[rank], at_bound[rank])
        assert reports[rank]["alltoall-ep2-dropless-random"]["native"] < 0.75 * bound_bytes
        one = reports[rank]["alltoall-ep4-dropless-one"]["capacity"]["pair_capacity"]
        assert one[2:] == [1, 1] and min(one[:2]) >= C.TOKENS // 2, one


# ---------------------------------------------------------------------------------------------
# aux-loss scope
# ---------------------------------------------------------------------------------------------
def reference_aux(x, weight):
    """Switch loss E/k sum_i f_i P_i over all rows of x and its gradient w.r.t. the router weight."""
    logits = x @ weight.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, -1)[:, :C.TOP_K]
    fraction = np.bincount(top.reshape(-1), minlength=C.EXPERTS) / len(x)
    scale = C.EXPERTS / C.TOP_K
    value = scale * (fraction * probs.mean(0)).sum()
    d_probs = scale * fraction / len(x)                                        # d value / d probs[t, i]
    d_logits = probs * (d_probs - (probs * d_probs).sum(-1, keepdims=True))    # softmax backward
    return value, d_logits.T @ x


@pytest.mark.distributed
def test_global_aux_loss_scale_equals_one_process_over_whole_batch(layer_run):
    """Every dp rank's 'global' aux loss is the one-process loss over all ranks' tokens, and the
    router gradients averaged over dp (what the trainer applies) are its full gradient, not 1/dp."""
    arrays, _ = layer_run
    weight = C.router_weight().astype(np.float64)
    xs = [C.aux_tokens(r).reshape(-1, C.HIDDEN).astype(np.float64) for r in range(C.WORLD)]
    value, grad = reference_aux(np.concatenate(xs), weight)
    for rank in range(C.WORLD):
        assert float(arrays[rank]["aux/global/value"]) == pytest.approx(value, rel=1e-5)
    mean_grad = np.mean([arrays[r]["aux/global/router_grad"] for r in range(C.WORLD)], 0)
    np.testing.assert_allclose(mean_grad, grad, rtol=1e-4, atol=1e-6)
    # the per-micro-batch scope is each rank's own loss: a different number
    for rank in range(C.WORLD):
        local_value, local_grad = reference_aux(xs[rank], weight)
        assert float(arrays[rank]["aux/micro_batch/value"]) == pytest.approx(local_value, rel=1e-5)
        np.testing.assert_allclose(arrays[rank]["aux/micro_batch/router_grad"], local_grad, rtol=1e-4, atol=1e-6)
    assert abs(value - np.mean([reference_aux(x, weight)[0] for x in xs])) > 1e-3


# ---------------------------------------------------------------------------------------------
# Training: dp4 with expert parallelism against one process on the same global batches
# ---------------------------------------------------------------------------------------------
DATA = os.path.join(REPO, "data", "kjv_tiny")
STEPS = 20
# configs/moe_tiny.yaml at its depth (4 MoE layers, 8 experts top-2) and default options, narrower and
# shorter (hidden 64, 32 tokens) so that 20 steps of each run fit the suite
TINY_MOE = ",".join([
    "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=128", "model.seq_length=32", "model.moe.ffn_hidden_size=64",
    "model.moe.bias_update_rate=0.01",      # the bias follows the global load
    "parallel.moe_capacity_prior=4",        # the first capacities are the bound: the first sizing shrinks them
    f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=2",
    f"data.path={DATA}/kjv_tiny_train", f"data.tokenizer={DATA}/kjv_tiny.model", "data.eval_path=",
    "checkpoint.save_at_end=false", "checkpoint.save_steps=0", "logging.tensorboard=false",
    "logging.progress_bar=false", "logging.log_interval=1"])
CAPACITY = "model.moe.capacity_factor=1.0"
# no per-element normalisation and no clipping: a wrong gradient scale shows in the loss
SGD = "optimizer.name=sgd,optimizer.lr=0.1,optimizer.clip_grad_norm=0,optimizer.weight_decay=0"
# run -> (one-process reference, overrides); every run is dp4 with micro-batches of 2, the reference
# one process with 4 micro-batches of 2: the same samples in the same micro-batches.
EP_RUNS = {
    "ep4-alltoall": ("dropless", "parallel.expert_parallel=4,parallel.moe_token_dispatcher=alltoall"),
    # SGD checks the gradients' scale exactly; at the bound (one graph) it costs no recompiles, and
    # the adaptive capacities are the AdamW run's (and the layout matrix's, benchmarks/layout_matrix.py)
    "ep4-alltoall-sgd": ("dropless-sgd", f"parallel.expert_parallel=4,parallel.moe_token_dispatcher=alltoall,{SGD},"
                                         f"parallel.moe_capacity=bound"),
    "ep2-allgather-zero2": ("dropless", "parallel.expert_parallel=2,parallel.moe_token_dispatcher=allgather,"
                                        "parallel.optimizer_shard=2"),
    "ep2-alltoall-capacity": ("capacity", f"parallel.expert_parallel=2,parallel.moe_token_dispatcher=alltoall,"
                                          f"{CAPACITY}"),
}   # each dispatcher at ep2 and ep4 (dropless and capacity, skewed routing) is checked per rank
    # against numpy in the dispatcher cases above; allgather's capacity drops there too
REFERENCES = {"dropless": TINY_MOE, "dropless-sgd": f"{TINY_MOE},{SGD}", "capacity": f"{TINY_MOE},{CAPACITY}"}
# the test-only hook of tests/workers/ep_train_worker.py: buffers at half the need, overflows ignored; a
# prior of a quarter of the even share (14 rows a pair against a need of at least 32) undersizes the
# first call already, so the run stops at step 1 after one compile (the bound's graph, then the halved
# one, cost two)
UNDERSIZED = ("ep4-undersized:" + TINY_MOE + ",parallel.data_parallel=4,parallel.expert_parallel=4,"
              "parallel.moe_capacity_prior=0.25,+undersize")
# expert loads: exact for the first steps; later another summation order may flip a near-tied
# routing decision (one assignment moves: two counts of one); layers x flips allowed
EXACT_LOAD_STEPS, LOAD_SLACK = 5, 8
CONFIG = os.path.join(REPO, "configs", "moe_tiny.yaml")
WORKER = os.path.join(REPO, "tests", "workers", "ep_train_worker.py")


@pytest.fixture(scope="module")
def training(ep_job):
    """(the one-process references' step records, every rank's) of the training runs."""
    job, (proc, log, out) = ep_job
    if proc.wait(timeout=900) != 0:
        log.seek(0)
        raise AssertionError(f"the one-process references failed:\n{log.read()[-3000:]}")
    with open(os.path.join(out, "rank_0.json")) as fh:
        reference = json.load(fh)
    ranks = []
    for rank in range(C.WORLD):
        with open(os.path.join(job.out_dir, "train", f"rank_{rank}.json")) as fh:
            ranks.append(json.load(fh))
    return reference, ranks


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", list(EP_RUNS))
def test_training_matches_one_process(training, run):
    """The README model's depth, 20 steps: loss, grad_norm and aux terms of every step, expert loads
    (exact for the first steps), and every routed row computed once (dropless)."""
    reference, ranks = training
    expected = reference[EP_RUNS[run][0]]
    assert len(expected) == STEPS
    for rank, results in enumerate(ranks):
        assert len(results[run]) == STEPS, f"{run} rank {rank}: {results[run][-1]}"
        for step, (got, want) in enumerate(zip(results[run], expected), 1):
            where = f"{run} rank {rank} step {step}"
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), where
            for key in ("aux_loss", "z_loss", "lm_loss"):
                assert got[key] == pytest.approx(want[key], rel=1e-4), f"{where} {key}"
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), where
            apart = np.abs(np.asarray(got["expert_load"]) - np.asarray(want["expert_load"])).sum(-1)
            assert apart.max() <= (0 if step <= EXACT_LOAD_STEPS else LOAD_SLACK), f"{where}: loads {apart}"
            assert got["routed"] == want["routed"], where
            if EP_RUNS[run][0] == "capacity":
                assert got["dropped"] == pytest.approx(want["dropped"], abs=LOAD_SLACK * (step > EXACT_LOAD_STEPS)), where
            else:                                  # rows layout (grouped GEMM kernel): only routed rows
                assert got["dropped"] == 0 and got["expert_rows"] == got["routed"], where
    if EP_RUNS[run][0] == "capacity":
        assert sum(step["dropped"] for step in expected) > 0, "the capacity runs should drop tokens"


@pytest.mark.slow
@pytest.mark.distributed
def test_adaptive_capacities_grow_and_shrink_and_every_layer_shares_them(training):
    """The default (adaptive) dispatch buffers of the dp4.ep4 AdamW run: sized down from the bound,
    grown (with a re-run) as the routing drifts, and every MoE layer holds the same set at every step
    (issue 30: per-layer sets lost rows in the shared block graph); rows are exact throughout
    (test_training_matches_one_process). The SGD run keeps the bound (`parallel.moe_capacity: bound`)."""
    _, ranks = training
    assert not any("capacities" in record for record in ranks[0]["ep4-alltoall-sgd"])   # not managed: the bound
    for run in ("ep4-alltoall",):
        records = ranks[0][run]
        pairs = [record["capacities"][0]["pair_capacity"] for record in records]
        for record in records:
            assert all(layer == record["capacities"][0] for layer in record["capacities"]), record["capacities"]
        assert len(record["capacities"]) == 4                                # the README model's 4 MoE layers
        assert records[-1]["reruns"] >= 1, f"{run}: no overflow re-run in {STEPS} steps"
        bound = [2 * 32 * 2] * 4                                              # T min(k, L) rows a pair
        steps = [bound] + pairs                                              # the prior is the bound
        shrank = any(any(b < a for a, b in zip(before, after)) for before, after in zip(steps, steps[1:]))
        grew = any(any(b > a for a, b in zip(before, after)) for before, after in zip(steps, steps[1:]))
        assert shrank and grew, f"{run}: the capacities did not both shrink and grow: {pairs}"


@pytest.mark.slow
@pytest.mark.distributed
def test_undersized_dispatch_stops_the_run_before_the_optimizer_step(training):
    """The test-only hook sizes the buffers at half the routing's need and skips the re-runs: rows are
    lost, and the dispatch invariant stops the run with its named error before the step is applied."""
    _, ranks = training
    for rank, results in enumerate(ranks):
        last = results["ep4-undersized"][-1]
        assert last.get("error") == "DispatchInvariantError", f"rank {rank}: {last}"
        assert last["steps_applied"] == 0, last                 # the prior (UNDERSIZED) undersizes the first call
        message = last["message"]
        assert f"dispatch invariant broken at step {last['steps_applied'] + 1}: MoE layer" in message, message
        assert "rows unaccounted" in message and "dp=4 tp=1 pp=1 ep=4" in message, message
        assert "capacities in force: {'pair_capacity': [" in message, message


# ---------------------------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_one_rank_dispatchers_equal_sort_dispatcher(ms, capacity_factor):
    """On a one-rank group every collective is the identity: the expert-parallel dispatchers must
    give SortDispatcher's output, loads, drops and gradients, in PyNative and under ms.jit."""
    from mindspore import Tensor

    from moetrain.moe.dispatcher import SortDispatcher
    from moetrain.moe.ep_dispatcher import AllGatherDispatcher, AllToAllDispatcher
    from moetrain.moe.experts import GroupedExperts
    from moetrain.distributed.topology import single_group

    idx, weight = C.routing("skewed", 0)
    x = Tensor(C.tokens("one-rank", 0))
    experts = GroupedExperts(C.EXPERTS, C.HIDDEN, C.FFN)
    for param, full in zip((experts.w_gate, experts.w_up, experts.w_down), C.expert_weights()):
        param.set_data(Tensor(full))

    def run(dispatcher, jit):
        def loss_fn(x, topk_weight):
            expert_input, state = dispatcher.dispatch(x, Tensor(idx), topk_weight)
            expert_output = experts(expert_input, state.get("row_expert"), state.get("group_sizes"))
            y = dispatcher.combine(expert_output, state)
            return (y * y).sum(), state["tokens_per_expert"], state["dropped"]

        fn = ms.value_and_grad(loss_fn, (0, 1), experts.trainable_params(), has_aux=True)
        (loss, load, dropped), (input_grads, param_grads) = (ms.jit(fn) if jit else fn)(x, Tensor(weight))
        return [t.asnumpy() for t in (loss, load, dropped, *input_grads, *param_grads)]

    expected = run(SortDispatcher(C.EXPERTS, C.TOP_K, capacity_factor, experts.layout), False)
    assert (float(expected[2]) > 0) == (capacity_factor > 0)
    for cls in (AllToAllDispatcher, AllGatherDispatcher):
        for jit in (False, True):
            got = run(cls(C.EXPERTS, C.TOP_K, capacity_factor, single_group("ep"), experts.layout), jit)
            for a, b in zip(got, expected):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{cls.__name__} jit={jit}")


def tiny_moe_gpt(**moe):
    from moetrain.config import model_config_from_dict

    cfg = model_config_from_dict({"name": "moe_gpt", "vocab_size": 64, "hidden_size": 16, "num_layers": 2,
                                  "num_heads": 2, "num_kv_heads": 2, "ffn_hidden_size": 32, "seq_length": 8,
                                  "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8, **moe}})
    from moetrain.registry import get_model

    return get_model("moe_gpt").cls(cfg)


def test_parallelize_moe_slices_experts_and_gradient_groups(ms):
    """Rank 1 of dp=4, ep=2 keeps experts 2-3 (marked for checkpoints); the optimizer reduces (and
    ZeRO-shards) expert gradients over edp = dp ranks {1, 3}, everything else over all 4 dp ranks."""
    from types import SimpleNamespace

    from moetrain.moe.ep_dispatcher import AllToAllDispatcher
    from moetrain.parallel.data_parallel import OptimizerStep
    from moetrain.moe.layer import moe_layers
    from moetrain.parallel.expert_parallel import parallelize_moe
    from moetrain.distributed.sharding import shard_spec
    from moetrain.distributed.topology import ParallelContext

    ms.set_seed(7)
    model = tiny_moe_gpt()
    full = {p.name: p.asnumpy() for p in model.get_parameters()}
    pctx = ParallelContext.build(world_size=4, rank=1, dp=4, ep=2)
    parallel = SimpleNamespace(moe_token_dispatcher="alltoall", moe_aux_loss_scope="micro_batch",
                               optimizer_shard=2, grad_bucket_mb=1.0, grad_reduce_dtype="float32",
                               ep_splits="auto")
    assert parallelize_moe(model, parallel, pctx) == 2
    for layer in moe_layers(model):
        assert isinstance(layer.dispatcher, AllToAllDispatcher) and layer.dispatcher.group.ranks == (0, 1)
        assert layer.experts.num_local_experts == 2
    for param in model.get_parameters():
        if ".experts." in param.name:
            np.testing.assert_array_equal(param.asnumpy(), full[param.name][2:4])
            assert shard_spec(param) == shard_spec(param).__class__(full[param.name].shape, 0, 1, 2, "ep")
        else:
            np.testing.assert_array_equal(param.asnumpy(), full[param.name])

    optimizer_cfg = SimpleNamespace(name="adamw", lr=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8,
                                    momentum=0.9, fused="auto")
    step = OptimizerStep(model.trainable_params(), optimizer_cfg, parallel, pctx, clip=0.0, jit=False)
    for b in step.buffers:
        for param, shard in zip(step.params[b.start:b.end], b.shards):
            expected = (1, 3) if ".experts." in param.name else (0, 1, 2, 3)
            assert b.group.ranks == expected, param.name
            assert shard == math.ceil(param.size / len(expected)), param.name
    assert sorted(p.name for p in step.params) == sorted(p.name for p in model.trainable_params())


def test_sequence_scope_is_mean_of_per_sequence_losses(ms):
    from mindspore import Tensor

    from moetrain.moe.config import MoEConfig
    from moetrain.moe.layer import MoELayer

    layer = MoELayer(C.HIDDEN, MoEConfig(num_experts=C.EXPERTS, top_k=C.TOP_K, ffn_hidden_size=C.FFN))
    layer.router.weight.set_data(Tensor(C.router_weight()))
    layer.set_aux_loss_scope("sequence")
    x = C.aux_tokens(0)
    _, stats = layer(Tensor(x))
    weight = C.router_weight().astype(np.float64)
    per_sequence = [reference_aux(seq.astype(np.float64), weight)[0] for seq in x]
    assert float(stats["aux_loss"]) == pytest.approx(np.mean(per_sequence), rel=1e-5)
    with pytest.raises(ValueError, match="'sequence' aux loss scope needs the sequence boundaries"):
        layer(Tensor(x.reshape(-1, C.HIDDEN)))


def test_configuration_errors_say_what_to_change(ms):
    from types import SimpleNamespace

    from moetrain.moe.ep_dispatcher import build_ep_dispatcher
    from moetrain.moe.layer import MoELayer
    from moetrain.moe.config import MoEConfig
    from moetrain.parallel.expert_parallel import parallelize_moe
    from moetrain.distributed.topology import ParallelContext, single_group

    pctx = ParallelContext.build(world_size=4, rank=0, dp=4, ep=4)
    parallel = SimpleNamespace(moe_token_dispatcher="alltoall", moe_aux_loss_scope="micro_batch")
    with pytest.raises(ValueError, match="3 experts cannot be split evenly over parallel.expert_parallel=4"):
        parallelize_moe(tiny_moe_gpt(num_experts=3, top_k=1), parallel, pctx)
    with pytest.raises(ValueError, match="apply to MoE layers, and model Dense has none"):
        parallelize_moe(type("Dense", (ms.nn.Cell,), {})(), parallel, pctx)
    with pytest.raises(ValueError, match="'bogus' is not one of"):
        build_ep_dispatcher("bogus", 4, 2, 0.0, single_group("ep"))
    layer = MoELayer(C.HIDDEN, MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=4))
    with pytest.raises(ValueError, match="'global' scope needs the data-parallel group"):
        layer.set_aux_loss_scope("global")
    with pytest.raises(ValueError, match="'per_token' is not one of"):
        layer.set_aux_loss_scope("per_token")
