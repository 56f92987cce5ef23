"""Context parallelism under msrun: `configs/moe_tiny.yaml` at its real depth (4 MoE layers, 8 experts
top-2, GQA 4/2 heads) with each 64-token sequence split over 2 ranks (load-balanced chunks) reproduces
one process over 10 steps of 2 micro-batches of 4 sequences: loss, lm / aux / sequence aux / z losses within 1e-5
relative, grad_norm within 1e-4, expert loads exact for the first 5 steps and within a few tokens after
(another summation order may flip a near-tied routing decision). Three runs:
  cp2              K|V all-gathered, blockwise attention merged by log-sum-exp; and the evaluation loss
  cp2_p2p_packed   the same blockwise attention on K|V blocks passed around the ring, on packed
                   documents (data.reset_attention_mask, reset_position_ids: the keys' document ids
                   travel with them, the masks cross the chunk boundaries), against a packed reference
  cp2_a2a_zero1    Ulysses all-to-alls around the layer's own attention, the optimizer state sharded
                   (ZeRO-1) over the dp x cp group (here the 2 cp ranks)
They join the suite's shared 2-rank job (tests/distributed.py: share_runs); the one-process references
train beside the launch."""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed import share_runs, shared_reference_dirs, shared_run_dirs, step_records  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KJV = os.path.join(ROOT, "data", "kjv_tiny", "kjv_tiny")
STEPS, EXACT_STEPS = 10, 5
RUN = [f"data.path={KJV}_train", f"data.eval_path={KJV}_eval", f"data.tokenizer={KJV}.model",
       "model.seq_length=64", f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=4",
       "train.eval_interval=0",
       "train.eval_max_batches=1", "checkpoint.save_at_end=false", "checkpoint.save_steps=0",
       "logging.tensorboard=false", "logging.progress_bar=false"]
CP2 = ["parallel.context_parallel=2"]
PACKED = ["data.reset_attention_mask=true", "data.reset_position_ids=true"]


def spec(name, extra=()):
    return f"{name}:configs/moe_tiny.yaml:" + ",".join(RUN + list(extra))


RUNS = {"cp2": CP2,                                                        # K|V all-gathered, blockwise attention
        "cp2_p2p_packed": CP2 + ["parallel.cp_comm_type=p2p", "data.eval_path="] + PACKED,   # the ring, documents
        "cp2_a2a_zero1": CP2 + ["parallel.cp_comm_type=a2a", "parallel.optimizer_shard=1", "data.eval_path="]}
share_runs(2, __name__, lambda fixture, out_dir: [spec(name, extra) for name, extra in RUNS.items()], timeout=900,
           references=lambda fixture: [spec("reference"), spec("reference_packed", PACKED + ["data.eval_path="])])


@pytest.fixture(scope="module")
def runs(shared_job_2):
    return (shared_run_dirs(shared_job_2, __name__, RUNS),
            shared_reference_dirs(shared_job_2, __name__, ["reference", "reference_packed"]))


def eval_loss(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r["eval_loss"] for r in map(json.loads, fh) if "eval_loss" in r]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_cp2_reproduces_one_process(runs, name):
    run_dirs, reference_dirs = runs
    reference_dir = reference_dirs["reference_packed" if name.endswith("packed") else "reference"]
    steps, reference = step_records(run_dirs[name]), step_records(reference_dir)
    assert [r["step"] for r in steps] == [r["step"] for r in reference] == list(range(1, STEPS + 1))
    for key, rtol in (("loss", 1e-5), ("lm_loss", 1e-5), ("aux_loss", 1e-5), ("seq_aux_loss", 1e-5), ("z_loss", 1e-5),
                      ("grad_norm", 1e-4)):
        np.testing.assert_allclose([r[key] for r in steps], [r[key] for r in reference], rtol=rtol, err_msg=key)
    for a, b in zip(reference[:EXACT_STEPS], steps[:EXACT_STEPS]):
        np.testing.assert_array_equal(b["expert_load"], a["expert_load"], err_msg=f"step {a['step']}")
    for a, b in zip(reference[EXACT_STEPS:], steps[EXACT_STEPS:]):
        assert np.abs(np.subtract(b["expert_load"], a["expert_load"])).max() <= 4, f"step {a['step']}"
    assert [r["routed"] for r in steps] == [r["routed"] for r in reference]
    if name.endswith("packed"):                                        # the documents change what is learnt
        unpacked = step_records(reference_dirs["reference"])
        assert abs(reference[-1]["loss"] - unpacked[-1]["loss"]) > 1e-3
    assert reference[0]["loss"] - reference[-1]["loss"] > 0.5          # it trains
    if name == "cp2":
        np.testing.assert_allclose(eval_loss(run_dirs[name]), eval_loss(reference_dir), rtol=1e-5)
    ranks = [json.load(open(os.path.join(run_dirs[name], f"rank_{r}.json"))) for r in range(2)]
    assert [r["cp_rank"] for r in ranks] == [0, 1] and [r["dp_rank"] for r in ranks] == [0, 0]
    assert all(r["context_parallel_layers"] == 4 for r in ranks)      # every attention layer split
    if name == "cp2_a2a_zero1":                                        # the optimizer state sharded over the 2 ranks
        assert all(r["zero_level"] == 1 for r in ranks)
        whole = json.load(open(os.path.join(run_dirs["cp2"], "rank_0.json")))["optimizer_state_bytes"]
        assert all(r["optimizer_state_bytes"] == pytest.approx(whole / 2, rel=0.01) for r in ranks)
