"""The native code paths train under msrun on CPU: with `MOETRAIN_COMM_BACKEND=contract` every
MindSpore primitive the Ascend or the GPU path calls is a checked CPU reference
(`moetrain/testing/contract.py`), and the real Trainer trains a moe_tiny-width model on

    2 ranks (shared job):  dp2·ep2, alltoall dispatcher, dropless   Ascend path (AlltoAll, jit),
                                                                    GPU path (AllGather, PyNative),
                                                                    Ascend MoE path with exact splits
                                                                    (AlltoAllV with Tensor counts, MoE
                                                                    op contracts, PyNative)
    4 ranks (shared job):  tp2·pp2, 1F1B, sequence parallel         Ascend path, GPU path (PairLink: Send/Receive)

reproducing one process (loss, lm/aux/z losses and the gradient norm within 1e-4 over 3 steps,
expert loads exact). Each run's rank files name the backend, the target and the stand-ins that
comm constructed, so a run cannot pass on the emulation by accident (the Ascend-only AlltoAll
refuses to be built on the GPU path). That the contract bites (a mutated axis, root, group, count or
pairing fails) is tested op by op in tests/test_comm.py (`test_mutated_native_call_site_fails`);
negative control for this file: the contract's AlltoAll concatenating its sources in reverse order
makes the Ascend dp2·ep2 losses differ at the third decimal (docs/parallel_engine.md). The byte
ledger is compared with the primitive calls the worker recorded (buffer shapes that entered them):
over the whole PyNative GPU dp2·ep2 run, and over the host-driven calls of the Ascend tp2·pp2 run.
"""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
from distributed import (assert_same_steps, share_runs, shared_reference_dirs, shared_run_dirs,  # noqa: E402
                         step_records)
from workers.comm_recorder import native_bytes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/moe_tiny.yaml"
KJV = os.path.join(ROOT, "data", "kjv_tiny", "kjv_tiny")
MODEL = [
    f"data.path={KJV}_train", f"data.eval_path={KJV}_eval", f"data.tokenizer={KJV}.model",
    "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=128", "model.seq_length=32", "model.vocab_size=2048",
    "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=64",
    "model.moe.aux_loss_coeff=0.01", "model.moe.z_loss_coeff=0.001",
    "train.steps=3", "train.global_batch_size=4", "train.micro_batch_size=1", "train.eval_interval=0",
    "train.eval_max_batches=1", "lr_schedule.warmup_steps=0", "optimizer.clip_grad_norm=0.05",
    "checkpoint.save_at_end=false", "checkpoint.save_steps=0", "logging.tensorboard=false",
    "logging.progress_bar=false",
]
CONTRACT = "MOETRAIN_COMM_BACKEND=contract"
DP2_EP2 = ["parallel.data_parallel=2", "parallel.expert_parallel=2", "parallel.moe_token_dispatcher=alltoall",
           "parallel.optimizer_shard=1"]
TP2_PP2 = ["parallel.model_parallel=2", "parallel.pipeline_stage=2", "parallel.use_seq_parallel=true"]
LAUNCHES = {
    # the GPU run in PyNative: the contract checks every call across the ranks too, and the worker
    # records every primitive call (tests/workers/comm_recorder.py) for the ledger test
    2: {"ascend_dp2_ep2": DP2_EP2 + [CONTRACT, "MOETRAIN_CONTRACT_TARGET=Ascend"],
        "gpu_dp2_ep2": DP2_EP2 + ["train.jit=false", "+record_primitives", CONTRACT, "MOETRAIN_CONTRACT_TARGET=GPU"],
        # the whole Ascend MoE path: moe_token_permute/unpermute, grouped_matmul_v4 and the exact-split
        # dispatch (AlltoAllV with device-side counts; the contract computes it in PyNative only)
        "ascend_exact_dp2_ep2": DP2_EP2 + ["train.jit=false", "+record_primitives", CONTRACT,
                                           "MOETRAIN_CONTRACT_TARGET=Ascend", "MOETRAIN_MOE_PLATFORM=ascend"]},
    4: {"ascend_tp2_pp2": TP2_PP2 + ["+record_primitives", CONTRACT, "MOETRAIN_CONTRACT_TARGET=Ascend"],
        "gpu_tp2_pp2": TP2_PP2 + [CONTRACT, "MOETRAIN_CONTRACT_TARGET=GPU"]},
}


# the reference's steps are compared, never its evaluation (the runs' own evaluations are counted in the
# primitive ledgers): its evaluation graph would be compiled for nothing
NO_EVAL = ["data.eval_path="]


def spec(name, parallel=()):
    return f"{name}:{CONFIG}:" + ",".join(MODEL + list(parallel))


def rank_records(run_dir, nproc):
    return [json.load(open(os.path.join(run_dir, f"rank_{r}.json"))) for r in range(nproc)]


# each world size's runs join the suite's shared msrun job of that size (tests/distributed.py: share_runs),
# last: the recorder the worker installs for +record_primitives stays in the process; the one-process
# reference trains beside the 2-rank job
for _nproc, _runs in LAUNCHES.items():
    share_runs(_nproc, __name__, lambda fixture, out_dir, runs=_runs: [spec(name, parallel)
                                                                      for name, parallel in runs.items()],
               timeout=900, last=True, references=(lambda fixture: [spec("reference", NO_EVAL)]) if _nproc == 2 else None)


@pytest.fixture(scope="module")
def one_process(shared_job_2):
    """The reference, on the emulated backend, in one process beside the shared 2-rank job."""
    return step_records(shared_reference_dirs(shared_job_2, __name__, ["reference"])["reference"])


def launch(nproc, out_dir):
    return {name: (step_records(run_dir), rank_records(run_dir, nproc))
            for name, run_dir in shared_run_dirs(out_dir, __name__, LAUNCHES[nproc]).items()}


@pytest.fixture(scope="module")
def two_ranks(shared_job_2):
    return launch(2, shared_job_2)


@pytest.fixture(scope="module")
def four_ranks(shared_job_4):
    return launch(4, shared_job_4)


def assert_reproduces(reference, steps, name):
    assert_same_steps(reference, steps, name, num_steps=3)
    assert all(b["dropped"] == a["dropped"] == 0 for a, b in zip(reference, steps)), name    # dropless


def assert_ran_the_native_path(ranks, target, must, must_not):
    for info in ranks:
        assert (info["comm_backend"], info["native_target"]) == ("contract", target), info["rank"]
        built = info["contract_primitives"]
        assert all(built.get(op, 0) > 0 for op in must), (info["rank"], built)
        assert not any(op in built for op in must_not), (info["rank"], built)


@pytest.mark.distributed
@pytest.mark.parametrize("target", ["Ascend", "GPU"])
def test_dp2_ep2_native_path_reproduces_one_process(one_process, two_ranks, target):
    name = f"{target.lower()}_dp2_ep2"
    steps, ranks = two_ranks[name]
    assert_reproduces(one_process, steps, name)
    # Ascend: the tokens travel with AlltoAll; GPU has no AlltoAll (Ascend-only): AllGather of the outboxes
    if target == "Ascend":
        assert_ran_the_native_path(ranks, target, must=("AlltoAll", "AllReduce"), must_not=())
    else:
        assert_ran_the_native_path(ranks, target, must=("AllGather", "AllReduce"), must_not=("AlltoAll", "AlltoAllV"))


@pytest.mark.distributed
@pytest.mark.parametrize("target", ["Ascend", "GPU"])
def test_tp2_pp2_native_path_reproduces_one_process(one_process, four_ranks, target):
    name = f"{target.lower()}_tp2_pp2"
    steps, ranks = four_ranks[name]
    assert_reproduces(one_process, steps, name)
    # sequence parallel: AllGather/ReduceScatter over tp; the pipeline's links: Send/Receive
    assert_ran_the_native_path(ranks, target, must=("AllGather", "ReduceScatter", "Send", "Receive"),
                               must_not=("AlltoAll", "AlltoAllV"))
    for info in ranks:   # 4 micro-batches of [1, 16, 64] fp32 (sequence split over tp) each way per step
        assert info["step_bytes_sent"] == 4 * 16 * 64 * 4, info["rank"]
    if target == "Ascend":
        # recorded: the host-driven calls (the stages' compute is jitted): PairLink's Send/Receive, one
        # per micro-batch and step (3 x 4) plus the first stage's 4 evaluation batches (eval_max_batches=1:
        # one global batch of 4 samples, in batches of micro_batch_size=1), the metric
        # all-reduces over the pp group, and the optimizer step's (its fused path runs in PyNative,
        # data_parallel.OptimizerStep): the sequence-parallel norm weights' gradients summed over tp
        # and the squared gradient norm over the world; the ledger books each under its group
        for info in ranks:
            calls, booked = info["primitive_calls"], info["ledger"]["native"]
            sends = [c for c in calls if c["prim"] == "Send"]
            receives = [c for c in calls if c["prim"] == "Receive"]
            first = info["pp_rank"] == 0
            assert (len(sends), len(receives)) == ((12 + 4, 12) if first else (12, 12 + 4)), info["rank"]
            assert all(c["tensors"][0]["shape"] == [1, 16, 64] for c in sends), info["rank"]
            assert set(booked) == {"pp", "tp", "world"}, booked
            # a step: the gradient norm (each rank's float64 sum of squares as two fp32, all-gathered:
            # (4 - 1) x 8 bytes) and the dispatch invariant's rows ([2 MoE layers, 4] fp32, all-reduced)
            assert booked["world"] == pytest.approx(3 * ((4 - 1) * 2 * 4 + 2 * (4 - 1) / 4 * 4 * 2 * 4)), booked
            assert sum(booked.values()) == pytest.approx(sum(native_bytes(c) for c in calls), abs=1), (info["rank"],
                                                                                                       booked)


@pytest.mark.distributed
def test_pynative_run_checked_across_ranks_and_its_ledger_counts_the_primitives_it_called(two_ranks):
    """dp2·ep2 on the GPU path in PyNative: every primitive call is checked against the other rank's
    (op, shape, dtype, attributes) and recorded with the buffer that entered it; the ledger's native
    bytes over the whole fit equal the textbook count of those buffers (the dispatcher's padded
    outboxes, gathered whole on GPU, included), per rank."""
    _, ranks = two_ranks["gpu_dp2_ep2"]
    for info in ranks:
        calls = info["primitive_calls"]
        gathered = [c["tensors"][0]["shape"] for c in calls if c["prim"] == "AllGather"]
        # this rank's outboxes [1, dst, rows, hidden]: rows sized to the routed load (at most the
        # bound T min(k, L) = 64), beside the [1, dst, 1, 2] exchanges of the counts that size them
        outboxes = [shape for shape in gathered if len(shape) == 4 and shape[1] == 2 and shape[3] == 64]
        assert outboxes and all(1 <= shape[2] <= 64 for shape in outboxes), (info["rank"], gathered)
        assert [1, 2, 1, 2] in gathered, info["rank"]
        assert not {"AlltoAll", "AlltoAllV"} & {c["prim"] for c in calls}, info["rank"]
        booked = info["ledger"]["native"]
        assert booked.get("ep", 0) > 0 and booked.get("dp", 0) > 0, booked
        recorded = sum(native_bytes(c) for c in calls)
        assert sum(booked.values()) == pytest.approx(recorded, abs=len(booked)), (info["rank"], booked, recorded)


@pytest.mark.distributed
def test_exact_split_dispatch_reproduces_one_process_and_computes_exactly_the_routed_rows(one_process, two_ranks):
    """dp2·ep2 on the whole Ascend MoE path (contract ops, PyNative): the dropless alltoall sends
    exactly the routed rows (AlltoAllV with Tensor counts, no capacities, no re-runs), the expert
    GEMMs compute exactly them, and the run reproduces one process (CPU path) within 1e-5."""
    steps, ranks = two_ranks["ascend_exact_dp2_ep2"]
    assert_same_steps(one_process, steps, "ascend_exact_dp2_ep2", num_steps=3, rtol=1e-5)
    assert all(b["dropped"] == 0 for b in steps)
    for step in steps:
        assert step["expert_rows"] == step["routed"] > 0, step
    hidden, layer_calls = 64, 3 * 2 * 2     # 3 steps x 2 micro-batches per rank x 2 MoE layers
    eval_calls = 2 * 2                      # then the final evaluation, forward only: one global batch of 4 samples
                                            # (eval_max_batches=1) in batches of 1, 2 per rank, x 2 MoE layers
    rows_sent = 0
    for info in ranks:
        assert (info["comm_backend"], info["native_target"]) == ("contract", "Ascend"), info["rank"]
        calls = info["primitive_calls"]
        counts = [c for c in calls if c["prim"] == "AlltoAll"]
        moved = [c for c in calls if c["prim"] == "AlltoAllV"]
        # per layer call: the [ep, L] counts once (no backward), then the rows: dispatch and combine,
        # each forward and backward; block_size = hidden (counts in rows), the input exactly the rows
        assert [c["tensors"][0]["shape"] for c in counts] == [[2, 2]] * (layer_calls + eval_calls), info["rank"]
        assert len(moved) == 4 * layer_calls + 2 * eval_calls, info["rank"]
        assert all(c["block_size"] == hidden for c in moved), info["rank"]
        assert all(c["tensors"][0]["shape"] == [hidden * sum(c["send"])] for c in moved), info["rank"]
        rows_sent += sum(sum(c["send"]) for c in moved[:4 * layer_calls])      # the training steps'
        booked = info["ledger"]["native"]
        recorded = sum(native_bytes(c) for c in calls)
        assert sum(booked.values()) == pytest.approx(recorded, abs=len(booked)), (info["rank"], booked, recorded)
    # every routed assignment travels to its expert and back, in the forward and in the backward,
    # and nothing else does (no padding): 4 x the routed rows of the run, counted by the router
    assert rows_sent == 4 * sum(step["routed"] for step in steps)
