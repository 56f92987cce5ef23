"""bfloat16 training (docs/precision.md) on the parallel layouts against ONE one-process bf16 run of the
same config: dp4 . ep2 (ZeRO-1, alltoall dispatch) and tp2 . pp2 with sequence parallelism (1F1B), two
runs of the suite's shared 4-rank launch (tests/distributed.py `share_runs`), the reference beside it;
and dp2 . ep2 on the Ascend code path (the contract backend, tests/test_contract_training.py), one run
of the shared 2-rank launch.

The model is test_parallel_3d's tiny MoE (hidden 64, 2 MoE layers of 4 experts top-2, tied embeddings,
seq 32; KJV data), dropless, 3 steps of 8 sequences in micro-batches of 1, clipping at 0.05. In bf16 a
layout changes where the fp32 partial sums are rounded to bf16 (a tp row-parallel product rounds each
rank's partial before the all-reduce, the one process rounds the whole sum), so layouts agree to bf16's
reduction-order effects, not to fp32's 1e-4: the bounds below are about 3x the differences measured
here (see docs/precision.md)."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
from distributed import share_runs, shared_reference_dirs, shared_run_dirs  # noqa: E402
from test_parallel_3d import CONFIG, MODEL, load_run  # noqa: E402

# dropless, no aux-loss-free bias (its sign updates would amplify a routing difference of one token)
BF16 = [m for m in MODEL if not m.startswith(("model.moe.capacity_factor", "model.moe.bias_update_rate", "train.steps"))] + [
    "model.moe.capacity_factor=0.0", "train.steps=3", "precision.compute_dtype=bfloat16"]
# no final evaluation where its forward is the training forward's (the expert-parallel runs, the reference):
# nothing here reads it and its graph cost a third of each run; tp2.pp2 keeps it (the pipeline's own
# evaluation schedule passes bf16 activations between the stages)
NO_EVAL = ["data.eval_path="]
LAUNCHES = {
    "bf16_dp4_ep2": ["parallel.data_parallel=4", "parallel.expert_parallel=2", "parallel.optimizer_shard=1"] + NO_EVAL,
    "bf16_tp2_pp2_sp": ["parallel.model_parallel=2", "parallel.pipeline_stage=2", "parallel.use_seq_parallel=true"],
}
CONTRACT = {"bf16_ascend_dp2_ep2": ["parallel.data_parallel=2", "parallel.expert_parallel=2",
                                     "parallel.moe_token_dispatcher=alltoall", "parallel.optimizer_shard=1",
                                     "MOETRAIN_COMM_BACKEND=contract", "MOETRAIN_CONTRACT_TARGET=Ascend"] + NO_EVAL}
# Measured (2026-11-28; the runs are deterministic, two launches gave the same figures), largest over
# the 3 steps, relative:
#                   loss     aux_loss  z_loss   grad_norm  moved   params   router weight
#   dp4.ep2         9.3e-6   9.6e-5    2.8e-5   5.6e-4     0.29 %  5.2e-3   (in params)
#   tp2.pp2 + sp    3.1e-5   7.5e-4    4.8e-4   2.0e-3     0.49 %  3.5e-2   3.6e-2
#   Ascend dp2.ep2  3.6e-6   2.1e-6    7.5e-5   2.7e-4     0       5.1e-3   (in params)
# The bounds are about 3x the largest (parameters: per layout). The parameters are compared norm-wise:
# AdamW moves an element by about lr whatever its gradient's size, so where a gradient is ~0 bf16 noise
# flips the sign of the step, and a routed assignment that moves changes an expert's and the router's
# gradients by a whole token; element-wise they differ up to 16 % of the parameter's largest magnitude.
# (A row-parallel product's output is the fp32 sum of the ranks' bf16 partials, not rounded again.)
BOUNDS = {"loss": 1e-4, "lm_loss": 1e-4, "aux_loss": 2e-3, "z_loss": 1.5e-3, "grad_norm": 6e-3,
          "moved_assignments": 0.015, "router_weights": 0.1}


def specs(launches):
    return [f"{name}:{CONFIG}:" + ",".join(BF16 + parallel) for name, parallel in launches.items()]


share_runs(4, __name__, lambda fixture, out_dir: specs(LAUNCHES), timeout=1200,
           references=lambda fixture: [f"one_process_bf16:{CONFIG}:" + ",".join(BF16 + NO_EVAL)])
# last: as test_contract_training's runs, after the runs of the native CPU path
share_runs(2, __name__, lambda fixture, out_dir: specs(CONTRACT), timeout=600, last=True)


@pytest.fixture(scope="module")
def one_process(shared_job_4):
    run_dir = shared_reference_dirs(shared_job_4, __name__, ["one_process_bf16"])["one_process_bf16"]
    (steps, evals), _, params, _ = load_run(run_dir, 1)
    return steps, params[0]


@pytest.fixture(scope="module")
def four_ranks(shared_job_4):
    return {name: load_run(run_dir, 4) for name, run_dir in shared_run_dirs(shared_job_4, __name__, LAUNCHES).items()}


def relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def differences(single, run):
    """The largest relative differences of the run from the one-process run: per-step losses, gradient
    norm, the routed assignments that went to another expert (a fraction of all), and the parameters
    after training, norm-wise (`parameters`, asserted) and element-wise against the parameter's largest
    magnitude (reported: AdamW's update has the size lr whatever the gradient's, so an element whose
    gradient is ~0 moves by +-lr on the sign of its bf16 rounding noise)."""
    steps_a, single_params = single
    (steps_b, _), ranks, params, _ = run
    assert [r["step"] for r in steps_b] == [r["step"] for r in steps_a] == [1, 2, 3]
    out = {key: max(relative(b[key], a[key]) for a, b in zip(steps_a, steps_b))
           for key in ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm")}
    out["moved_assignments"] = max(np.abs(np.subtract(b["expert_load"], a["expert_load"])).sum() / 2 / b["routed"]
                                   for a, b in zip(steps_a, steps_b))
    out["parameters"] = out["parameters_elementwise"] = 0.0
    for info, held in zip(ranks, params):
        for name, value in held.items():
            _, axis, index, count, _ = info["shards"][name]
            full = single_params[name]
            want = (full if axis is None else np.split(full, count, axis=axis)[index]).astype(np.float64)
            normwise = float(np.linalg.norm(value - want) / max(np.linalg.norm(want), 1e-30))
            if name.endswith("router.weight"):
                out["router_weights"] = max(out.get("router_weights", 0.0), normwise)
            elif normwise > out["parameters"]:
                out["parameters"], out["worst_parameter"] = normwise, name
            out["parameters_elementwise"] = max(out["parameters_elementwise"], relative(value, want))
    return out


def check_layout(single, run, parameter_bound):
    with open(os.path.join(run[3], "resolved_config.yaml")) as fh:
        assert "compute_dtype: bfloat16" in fh.read()
    found = differences(single, run)
    print("measured:", {k: v if isinstance(v, str) else f"{v:.2e}" for k, v in found.items()})
    for key, bound in {**BOUNDS, "parameters": parameter_bound}.items():
        assert found[key] < bound, (key, found)


@pytest.fixture(scope="module")
def two_ranks(shared_job_2):
    return {name: load_run(run_dir, 2) for name, run_dir in shared_run_dirs(shared_job_2, __name__, CONTRACT).items()}


@pytest.mark.distributed
def test_bf16_dp4_ep2_reproduces_one_process(one_process, four_ranks):
    check_layout(one_process, four_ranks["bf16_dp4_ep2"], 1.5e-2)


@pytest.mark.distributed
def test_bf16_tp2_pp2_sp_reproduces_one_process(one_process, four_ranks):
    check_layout(one_process, four_ranks["bf16_tp2_pp2_sp"], 0.1)


@pytest.mark.distributed
def test_bf16_ascend_path_dp2_ep2_reproduces_one_process(one_process, two_ranks):
    run = two_ranks["bf16_ascend_dp2_ep2"]
    assert {(info["comm_backend"], info["native_target"]) for info in run[1]} == {("contract", "Ascend")}
    check_layout(one_process, run, 1.5e-2)
