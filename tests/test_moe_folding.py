"""MoE parallel folding (`parallel.expert_tensor_parallel`, expert parallelism spanning tensor-parallel
ranks) against one process, under msrun on CPU.

The suite's shared 4-rank msrun job (tests/distributed.py: share_runs; tp2 dp2) trains, one after
another (tests/workers/train_runs_worker.py):
  ascend_tp2_etp2_ep2   every expert's FFN split over the tp pair, experts over the dp pair, on the
                        native Ascend path (MOETRAIN_COMM_BACKEND=contract: AlltoAll); saves step 2
  tp2_etp2_ep1          etp 2 with ep 1 (emulated collectives): expert gradients reduced over edp
                        (the dp pair), never over tp
  tp2_ep4_sp            ep over all four ranks, each tp rank dispatching half of its dp rank's tokens,
                        sequence parallelism in the attention (emulated collectives; the allgather
                        dispatcher: no dropless capacities to resize, so no recompiles)
with a one-process reference beside the job, then one process resumes the step-2 checkpoint. Every layout
reproduces one process over 3 steps (losses and grad_norm within 1e-4, expert loads exactly; the
aux-loss-free bias moves every step, so routing changes); the resumed step 3 is within 1e-5 of the
reference's. The tp2 dp1 ep2 layout is tp2_ep4_sp's ep group within one dp rank; group membership
of every layout is tested without processes (tests/test_topology.py).
"""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed import (assert_same_steps, share_runs, shared_reference_dirs, shared_run_dirs,  # noqa: E402
                         step_records, train_one_process)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/moe_tiny.yaml"
KJV = os.path.join(ROOT, "data", "kjv_tiny", "kjv_tiny")
STEPS, SAVED_AT = 3, 2
MODEL = [
    f"data.path={KJV}_train", "data.eval_path=", f"data.tokenizer={KJV}.model",
    "model.hidden_size=64", "model.num_layers=1", "model.num_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=128", "model.seq_length=32", "model.vocab_size=2048",
    "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=64",
    "model.moe.aux_loss_coeff=0.01", "model.moe.z_loss_coeff=0.001", "model.moe.bias_update_rate=0.01",
    f"train.steps={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=1", "train.eval_interval=0",
    "lr_schedule.warmup_steps=0", "optimizer.clip_grad_norm=0.05", "checkpoint.save_at_end=false",
    "checkpoint.save_steps=0", "logging.tensorboard=false", "logging.progress_bar=false",
]
CONTRACT = "MOETRAIN_COMM_BACKEND=contract"
# the adaptive dispatch buffers (moetrain/moe/capacity.py) start at the even share, sized (44 rows a
# pair), which this routing never exceeds: one graph. At the default prior (the bound, 64, here) the
# first sizing shrank them to 36 and the next call overflowed, grew them and was re-run: three graphs
# for a 3-step run whose subject is the folding. Resizes and re-runs are tested on dp4.ep4
# (tests/test_expert_parallel.py) and against thousands of simulated routings (test_capacity_property.py).
ADAPTIVE_ONE_GRAPH = "parallel.moe_capacity_prior=1.0"
TP2_DP2 = ["parallel.model_parallel=2", "parallel.data_parallel=2"]
ETP2_EP2 = TP2_DP2 + ["parallel.expert_tensor_parallel=2", "parallel.expert_parallel=2"]
LAUNCHES = {
    4: {"ascend_tp2_etp2_ep2": ETP2_EP2 + [CONTRACT, "MOETRAIN_CONTRACT_TARGET=Ascend",
                                           f"checkpoint.save_steps={SAVED_AT}", ADAPTIVE_ONE_GRAPH],
        "tp2_etp2_ep1": TP2_DP2 + ["parallel.expert_tensor_parallel=2"],
        "tp2_ep4_sp": TP2_DP2 + ["parallel.expert_parallel=4", "parallel.use_seq_parallel=true",
                                 "parallel.moe_token_dispatcher=allgather"]},
}
SAVER = "ascend_tp2_etp2_ep2"


def spec(name, parallel=()):
    return f"{name}:{CONFIG}:" + ",".join(MODEL + list(parallel))


share_runs(4, __name__, lambda fixture, out_dir: [spec(name, parallel) for name, parallel in LAUNCHES[4].items()],
           timeout=900, references=lambda fixture: [spec("reference")])


@pytest.fixture(scope="module")
def runs(shared_job_4, tmp_path_factory):
    """{name: (step records, rank records)} of every run: the layouts' and the reference's from the shared
    4-rank job, then one process resumes the saver's step-2 checkpoint."""
    out = {}
    for name, run_dir in shared_run_dirs(shared_job_4, __name__, LAUNCHES[4]).items():
        out[name] = (step_records(run_dir), [json.load(open(os.path.join(run_dir, f"rank_{r}.json")))
                                             for r in range(4)])
    out["saved"] = os.path.join(shared_job_4, f"{__name__}.{SAVER}", "checkpoints", f"step_{SAVED_AT:08d}")
    out["reference"] = (step_records(shared_reference_dirs(shared_job_4, __name__, ["reference"])["reference"]), [])
    resumed = train_one_process(str(tmp_path_factory.mktemp("one_process")),
                                spec("resumed", [f"resume={out['saved']}"]))
    out["resumed"] = (step_records(resumed), [])
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for launch in LAUNCHES.values() for n in launch])
def test_folded_layout_reproduces_one_process(runs, name):
    steps, ranks = runs[name]
    assert_same_steps(runs["reference"][0], steps, name, num_steps=STEPS)
    assert len({tuple(np.ravel(r["expert_load"])) for r in steps}) == STEPS      # routing changes every step
    for info in ranks:      # the native path where named, the emulated one otherwise
        native = name.startswith("ascend_")
        assert info["comm_backend"] == ("contract" if native else "emulated"), info["rank"]
        if native:
            assert info["native_target"] == "Ascend" and info["contract_primitives"].get("AlltoAll", 0) > 0
            # the dispatch buffers are managed (AdaptiveStep: counts gathered and checked every call)
            assert info["dispatch_graphs"] is not None and info["dispatch_reruns"] is not None, info["rank"]


@pytest.mark.distributed
def test_folded_layouts_split_the_experts_as_promised(runs):
    """What each rank holds (the reproduction alone could hide a run that did not split at all)."""
    w_up = "layers.0.moe.experts.w_up"                   # global [4 experts, 64, 64]
    for info in runs[SAVER][1]:                 # 2 of 4 experts, 32 of 64 FFN columns
        assert info["shapes"][w_up] == [2, 64, 32]
        assert info["shards"][w_up][1:] == [0, info["ep_rank"], 2, "ep"]
        assert info["shard_extra"][w_up] == [[2, info["etp_rank"], 2, "etp"]]
        assert (info["etp_rank"], info["ep_rank"]) == (info["tp_rank"], info["dp_rank"])
    for info in runs["tp2_etp2_ep1"][1]:                 # all experts, half the FFN
        assert info["shapes"][w_up] == [4, 64, 32] and info["shards"][w_up][1:] == [2, info["tp_rank"], 2, "etp"]
        assert info["shapes"]["layers.0.moe.experts.w_down"] == [4, 32, 64]
    for info in runs["tp2_ep4_sp"][1]:                   # one expert a rank: ep over tp first, then dp
        assert info["shapes"][w_up] == [1, 64, 64] and info["ep_rank"] == info["tp_rank"] + 2 * info["dp_rank"]


@pytest.mark.distributed
def test_folded_checkpoint_resumes_on_one_process(runs):
    """The step-2 checkpoint of tp2·etp2·ep2 (native path; expert pieces cut along two axes) reassembles and one
    process continues it: step 3 within 1e-5 of the uninterrupted one-process run, loads exact."""
    with open(os.path.join(runs["saved"], "metadata.json")) as fh:
        pieces = json.load(fh)["tensors"]["layers.0.moe.experts.w_up"]["pieces"]
    assert sorted((p["index"], p["extra"][0][1]) for p in pieces) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sorted(p["file"] for p in pieces) == [f"model-rank{r:05d}.safetensors" for r in range(4)]
    resumed, reference = runs["resumed"][0], runs["reference"][0][SAVED_AT:]
    assert [r["step"] for r in resumed] == [r["step"] for r in reference] == list(range(SAVED_AT + 1, STEPS + 1))
    for key in ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in resumed], [r[key] for r in reference], rtol=1e-5, err_msg=key)
    for a, b in zip(reference, resumed):
        np.testing.assert_array_equal(b["expert_load"], a["expert_load"])
