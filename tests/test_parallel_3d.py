"""Composite layouts through the real Trainer: tensor x pipeline (x data x expert) parallelism, with
sequence parallelism, ZeRO-1/2, recompute, gradient accumulation (pipeline micro-batches), tied
embeddings, capacity drops and aux-loss-free balancing, against ONE one-process run of the same config.

    4 ranks (the suite's shared 4-rank launch, three runs):
        dp2 . tp2                  sequence parallel, ZeRO-2, recompute full (4 accumulated micro-batches)
        tp2 . pp2                  1F1B, recompute full
        dp2 . pp2, ep2             GPipe, ZeRO-2, allgather dispatcher, recompute selective
    8 ranks:
        dp2 . tp2 . pp2, ep2       1F1B, sequence parallel, ZeRO-1, alltoall dispatcher, sharded checkpoint

All use the same tiny moe_tiny-like model (hidden 64, 2 MoE layers of 4 experts top-2 with capacity
1.0, tied embeddings, vocabulary 2048, seq 32; KJV data), global batch 8 in micro-batches of 1 (the
one-process run accumulates 8 of them: the same samples in the same micro-batches, so capacity
drops and the micro-batch aux loss are the same), clipping at 0.05 (every step clipped, so the
global gradient norm over tp, pp, ep and dp scales every update). Compared over 5 steps: loss,
lm/aux/z losses and the gradient norm (1e-4 relative), expert loads and drop counts (exact), the
final evaluation loss, and every rank's slice of every parameter after training.

Each msrun launch compiles every stage's graphs on 4 or 8 processes sharing 2 cores: minutes.
"""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
from distributed import run_workers, share_runs, shared_reference_dirs, shared_run_dirs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/moe_tiny.yaml"
KJV = os.path.join(ROOT, "data", "kjv_tiny", "kjv_tiny")
WORKER = "tests/workers/train_runs_worker.py"
CLIP = 0.05
MODEL = [
    f"data.path={KJV}_train", f"data.eval_path={KJV}_eval", f"data.tokenizer={KJV}.model",
    "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=128", "model.seq_length=32", "model.vocab_size=2048", "model.tie_embeddings=true",
    "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=64",
    "model.moe.aux_loss_coeff=0.01", "model.moe.z_loss_coeff=0.001", "model.moe.capacity_factor=1.0",
    "model.moe.bias_update_rate=0.01",
    "train.steps=5", "train.global_batch_size=8", "train.micro_batch_size=1", "train.eval_max_batches=2",
    "lr_schedule.warmup_steps=0", f"optimizer.clip_grad_norm={CLIP}", "checkpoint.save_at_end=false",
    "checkpoint.save_steps=0", "logging.tensorboard=false", "logging.progress_bar=false",
]
# The runs of a world size train one after another in one msrun launch (4 ranks: shared with other files).
LAUNCHES = {
    4: {
        "dp2_tp2": ["parallel.data_parallel=2", "parallel.model_parallel=2", "parallel.use_seq_parallel=true",
                    "parallel.optimizer_shard=2", "parallel.recompute=full"],
        "tp2_pp2": ["parallel.model_parallel=2", "parallel.pipeline_stage=2", "parallel.recompute=full"],
        "dp2_pp2_ep2": ["parallel.data_parallel=2", "parallel.pipeline_stage=2", "parallel.expert_parallel=2",
                        "parallel.moe_token_dispatcher=allgather", "parallel.optimizer_shard=2",
                        "parallel.pipeline_schedule=gpipe", "parallel.recompute=selective"],
    },
    8: {
        "dp2_tp2_pp2_ep2": ["parallel.data_parallel=2", "parallel.model_parallel=2", "parallel.pipeline_stage=2",
                            "parallel.expert_parallel=2", "parallel.moe_token_dispatcher=alltoall",
                            "parallel.use_seq_parallel=true", "parallel.optimizer_shard=1",
                            "checkpoint.save_at_end=true"],
    },
}
REL_TOL = 1e-4
STEP_KEYS = ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm")


def step_records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    return [r for r in records if "loss" in r], [r for r in records if "eval_loss" in r]


def load_run(run_dir, nproc):
    """(metrics of rank 0, every rank's record, every rank's parameters, the run's folder)."""
    ranks = [json.load(open(os.path.join(run_dir, f"rank_{r}.json"))) for r in range(nproc)]
    params = [dict(np.load(os.path.join(run_dir, f"rank_{r}.npz"))) for r in range(nproc)]
    return step_records(run_dir), ranks, params, run_dir


def launch(nproc, tmp_path_factory):
    job = run_workers(WORKER, nproc, specs(nproc), timeout=1800,
                      job_dir=str(tmp_path_factory.mktemp(f"job{nproc}"))).check()
    return {name: load_run(os.path.join(job.out_dir, name), nproc) for name in LAUNCHES[nproc]}


def specs(nproc):
    return [f"{name}:{CONFIG}:" + ",".join(MODEL + parallel) for name, parallel in LAUNCHES[nproc].items()]


# the suite's shared 4-rank job; the one-process reference trains beside it
share_runs(4, __name__, lambda fixture, out_dir: specs(4), timeout=1800,
           references=lambda fixture: [f"one_process:{CONFIG}:" + ",".join(MODEL)])


@pytest.fixture(scope="module")
def one_process(shared_job_4):
    """The reference every layout must reproduce: same config, one process, 8 micro-batches a step."""
    run_dir = shared_reference_dirs(shared_job_4, __name__, ["one_process"])["one_process"]
    records, ranks, params, _ = load_run(run_dir, 1)
    assert ranks[0]["num_micro_batches"] == 8
    return records, params[0]


@pytest.fixture(scope="module")
def four_ranks(shared_job_4):
    return {name: load_run(run_dir, 4) for name, run_dir in shared_run_dirs(shared_job_4, __name__, LAUNCHES[4]).items()}


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory):
    return launch(8, tmp_path_factory)


def assert_same_training(single, parallel):
    (steps_a, evals_a), (steps_b, evals_b) = single, parallel
    assert [r["step"] for r in steps_b] == [r["step"] for r in steps_a] == [1, 2, 3, 4, 5]
    for key in STEP_KEYS:
        np.testing.assert_allclose([r[key] for r in steps_b], [r[key] for r in steps_a], rtol=REL_TOL, err_msg=key)
    assert all(r["grad_norm"] > 10 * CLIP for r in steps_a)            # the clip acted on every step
    for a, b in zip(steps_a, steps_b):                                  # the same routing, exactly
        np.testing.assert_array_equal(b["expert_load"], a["expert_load"])
        assert (b["dropped"], b["routed"]) == (a["dropped"], a["routed"])
    assert any(r["dropped"] > 0 for r in steps_a)                      # capacity 1.0 drops some tokens
    # measured <= 2e-7; a stage whose compiled graphs missed the balancing bias was 3.6e-5 off
    assert evals_b[-1]["eval_loss"] == pytest.approx(evals_a[-1]["eval_loss"], rel=1e-5)


def assert_same_parameters(single_params, ranks, params):
    """Every rank's slice (tp: rows/columns, ep: experts; ZeRO: gathered back) of every parameter
    after 5 steps equals that slice of the one-process parameter; together they cover the model."""
    covered = {}
    for info, held in zip(ranks, params):
        assert sorted(held) == sorted(info["shards"])
        for name, value in held.items():
            global_shape, axis, index, count, _ = info["shards"][name]
            full = single_params[name]
            assert list(full.shape) == global_shape, name
            want = full if axis is None else np.split(full, count, axis=axis)[index]
            np.testing.assert_allclose(value, want, rtol=1e-3, atol=3e-5, err_msg=f"rank {info['rank']} {name}")
            covered.setdefault(name, set()).add(index if axis is not None else 0)
    assert sorted(covered) == sorted(single_params)
    for name, indices in covered.items():
        count = next(info["shards"][name][3] for info in ranks if name in info["shards"])
        assert indices == set(range(count)), name


def assert_metrics_agree_on_every_rank(steps, ranks):
    for info in ranks:   # metrics are reduced over pp and dp: every rank reports rank 0's values
        assert info["train"]["loss"] == pytest.approx(steps[-1]["loss"], rel=1e-6), info["rank"]
        np.testing.assert_array_equal(info["train"]["expert_load"], steps[-1]["expert_load"])


def zero_state_bytes(shapes, dp, edp):
    """AdamW's two fp32 moments of this rank's ZeRO shards: dense parameters split over dp, experts
    over edp (expert_bias is not trained)."""
    trained = [n for n in shapes if not n.endswith("expert_bias")]
    return 2 * 4 * sum(-(-int(np.prod(shapes[n])) // (edp if ".experts." in n else dp)) for n in trained)


def assert_tied_copies_identical(ranks, params, dp_tp_pairs):
    """The tied embedding lives on the first and the last stage (the same tp slice): kept identical."""
    for dp_rank, tp_rank in dp_tp_pairs:
        ends = [params[r["rank"]]["embed.weight"] for r in ranks
                if (r["dp_rank"], r["tp_rank"]) == (dp_rank, tp_rank)]
        assert len(ends) == 2
        np.testing.assert_array_equal(ends[0], ends[1])


@pytest.mark.distributed
def test_dp2_tp2_sp_zero2_recompute_reproduces_one_process(one_process, four_ranks):
    single, single_params = one_process
    run, ranks, params, _ = four_ranks["dp2_tp2"]
    assert_same_training(single, run)
    assert_same_parameters(single_params, ranks, params)
    assert_metrics_agree_on_every_rank(run[0], ranks)
    assert sorted((r["dp_rank"], r["tp_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for info in ranks:
        shapes = info["shapes"]
        assert info["num_micro_batches"] == 4 and info["zero_level"] == 2   # gradient accumulation
        assert shapes["layers.0.attention.wq.weight"] == [32, 64]           # 2 of 4 heads (tp2)
        assert shapes["embed.weight"] == [1024, 64]
        assert shapes["layers.1.moe.experts.w_gate"] == [4, 64, 64]         # no ep: every expert
        norms = sorted(n for n in shapes if n.endswith("norm.weight"))
        assert norms and sorted(info["summed_over_tp"]) == norms            # SP: norms summed over tp
        assert info["optimizer_state_bytes"] == zero_state_bytes(shapes, dp=2, edp=2)


@pytest.mark.distributed
def test_tp2_pp2_reproduces_one_process(one_process, four_ranks):
    single, single_params = one_process
    piped, ranks, params, _ = four_ranks["tp2_pp2"]
    assert_same_training(single, piped)
    assert_same_parameters(single_params, ranks, params)
    assert_metrics_agree_on_every_rank(piped[0], ranks)
    assert sorted((r["pp_rank"], r["tp_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for info in ranks:
        assert info["num_micro_batches"] == 8
        assert info["stage_layers"] == [info["pp_rank"], info["pp_rank"] + 1]
        assert info["peak_in_flight"] == 2 - info["pp_rank"]           # 1F1B: stages - stage
        # 8 micro-batches of [1, 32, 64] fp32 cross the link each way per step (no SP: whole sequence)
        assert info["step_bytes_sent"] == 8 * 1 * 32 * 64 * 4
        assert info["shapes"]["embed.weight"] == [1024, 64]            # vocabulary split over tp, both ends
        assert info["shapes"][f"layers.{info['pp_rank']}.moe.experts.w_gate"] == [4, 64, 64]   # replicated
        assert info["summed_over_tp"] == []
    assert_tied_copies_identical(ranks, params, [(0, 0), (0, 1)])


@pytest.mark.distributed
def test_dp2_pp2_ep2_zero2_gpipe_reproduces_one_process(one_process, four_ranks):
    single, single_params = one_process
    piped, ranks, params, _ = four_ranks["dp2_pp2_ep2"]
    assert_same_training(single, piped)
    assert_same_parameters(single_params, ranks, params)
    assert_metrics_agree_on_every_rank(piped[0], ranks)
    assert sorted((r["pp_rank"], r["dp_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for info in ranks:
        layer = info["pp_rank"]
        assert info["num_micro_batches"] == 4 and info["zero_level"] == 2
        assert info["peak_in_flight"] == 4                             # GPipe holds every micro-batch
        assert info["step_bytes_sent"] == 4 * 1 * 32 * 64 * 4
        assert info["shapes"][f"layers.{layer}.moe.experts.w_gate"] == [2, 64, 64]      # 2 of 4 experts
        assert info["shards"][f"layers.{layer}.moe.experts.w_gate"][1:] == [0, info["ep_rank"], 2, "ep"]
        assert info["optimizer_state_bytes"] == zero_state_bytes(info["shapes"], dp=2, edp=1)
    assert_tied_copies_identical(ranks, params, [(0, 0), (1, 0)])


@pytest.mark.distributed
def test_dp2_tp2_pp2_ep2_sp_zero1_reproduces_one_process(one_process, eight_ranks):
    single, single_params = one_process
    piped, ranks, params, run_dir = eight_ranks["dp2_tp2_pp2_ep2"]
    assert_same_training(single, piped)
    assert_same_parameters(single_params, ranks, params)
    assert_metrics_agree_on_every_rank(piped[0], ranks)
    assert sorted((r["pp_rank"], r["dp_rank"], r["tp_rank"]) for r in ranks) == sorted(
        (p, d, t) for p in range(2) for d in range(2) for t in range(2))
    for info in ranks:
        layer, shapes = info["pp_rank"], info["shapes"]
        assert info["num_micro_batches"] == 4 and info["zero_level"] == 1
        assert info["peak_in_flight"] == 2 - info["pp_rank"]
        # sequence parallel: the stage boundary carries [1, 32 / tp, 64] per micro-batch
        assert info["step_bytes_sent"] == 4 * 1 * 16 * 64 * 4
        assert shapes[f"layers.{layer}.moe.experts.w_gate"] == [2, 64, 64]        # 2 of 4 experts (ep2)
        assert info["shards"][f"layers.{layer}.moe.experts.w_gate"][1:] == [0, info["ep_rank"], 2, "ep"]
        assert shapes[f"layers.{layer}.attention.wq.weight"] == [32, 64]          # 2 of 4 heads (tp2)
        assert shapes["embed.weight"] == [1024, 64]
        norms = sorted(n for n in shapes if n.endswith("norm.weight"))
        assert norms and sorted(info["summed_over_tp"]) == norms                  # SP: norms summed over tp
        assert info["optimizer_state_bytes"] == zero_state_bytes(shapes, dp=2, edp=1)
    assert_tied_copies_identical(ranks, params, [(d, t) for d in range(2) for t in range(2)])
    # the sharded checkpoint written by the 8 ranks (tp, ep and stage pieces) reassembles the model
    from moetrain.checkpoint.distributed import CheckpointReader
    from moetrain.checkpoint.manager import latest_checkpoint

    reader = CheckpointReader(latest_checkpoint(os.path.join(run_dir, "checkpoints")))
    try:
        assert reader.step == 5 and sorted(reader.keys("model")) == sorted(single_params)
        for name, value in single_params.items():
            np.testing.assert_allclose(reader.global_tensor(name), value, rtol=1e-3, atol=3e-5, err_msg=name)
    finally:
        reader.close()
