"""`moetrain plan CONFIG --dry-run --json`: one rank of a layout built at full width in one process,
one step run, its memory measured and set against the plan. The byte counts are checked against an
independent count taken from a model built here (the Parameters' own shapes), not the planner's
formulas; the plan must then fall within issue 18's bounds of the measurement."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from background import run_in_background, wait_for_background  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "moe_tiny.yaml")
CATEGORIES = ("weights", "gradients", "optimizer", "activations", "dispatch_buffers")
SHORT = ["--set", "model.num_layers=2", "--set", "data.seq_length=64"]     # a few seconds of compute
# rank 1 of dp 2 x ep 2 with ZeRO-2: the expert split, the ZeRO shards and the stand-in collectives
EXPERT_PARALLEL = ["--set", "parallel.data_parallel=2", "--set", "parallel.expert_parallel=2",
                   "--set", "parallel.optimizer_shard=2", *SHORT]
# rank 1 of dp 2 with ZeRO-1 at moe_tiny's own depth and sequence: the bounds. (The ep layout is
# checked for exact static bytes and its dispatch buffers, which the planner books as the
# dispatcher sizes them; at 2 layers of 64 tokens the LM head's fixed terms, which the planner
# overstates on the CPU kernel path, weigh too much for the 25 % activation bound.)
# In bfloat16 (compute and gradient reduction), as the Ascend configs train: it runs in bf16 on this CPU
# (fp32 GEMMs on bf16 values, the SwiGLU activations in 2 bytes, docs/precision.md), not as float16.
DATA_PARALLEL = ["--set", "parallel.data_parallel=2", "--set", "parallel.optimizer_shard=1",
                 "--set", "precision.compute_dtype=bfloat16", "--set", "parallel.grad_reduce_dtype=bfloat16"]


def local_numels(dp: int, ep: int, layers: int = 2):
    """`(name, elements on one rank, ZeRO group size, trainable)` of every Parameter of moe_tiny
    with `layers` layers, from a model built here: routed-expert weights split over ep, the rest whole."""
    from moetrain.config import load_config
    from moetrain.build import build_model

    cfg = load_config(TINY, [f"model.num_layers={layers}"])
    out = []
    for p in build_model(cfg).get_parameters():
        n = int(np.prod(p.shape))
        expert = ".experts.w_" in p.name
        out.append((p.name, n // ep if expert else n, dp // ep if expert else dp, p.requires_grad))
    return out


# Both layouts' dry runs in one process, `moetrain plan --dry-run --rank 1 --json` (its `main`) once for
# each: one MindSpore start-up instead of two. Each dry run's memory record counts only its own
# block (dryrun.PoolRecorder); measured, both runs' planned and measured bytes and notes equal those of a
# process of their own (2026-11-28).
DRY_RUNS_DRIVER = r"""
import json, sys
from moetrain.planner.cli import main
for name, args in json.loads(sys.argv[1]).items():
    print(f"=== dry run {name}", flush=True)
    code = main(args)
    sys.stdout.flush()
    if code:
        sys.exit(f"the dry run {name} ended with {code}")
"""


@pytest.fixture(scope="module")
def dry_runs():
    """{"ep": ..., "dp": ...}: each one JSON object, the whole of its run's standard output (--json
    prints nothing else)."""
    layouts = {name: [TINY, "--dry-run", "--rank", "1", "--json", *layout]
               for name, layout in (("ep", EXPERT_PARALLEL), ("dp", DATA_PARALLEL))}
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", DRY_RUNS_DRIVER, json.dumps(layouts)], capture_output=True,
                            text=True, env=env, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    parts = result.stdout.split("=== dry run ")
    assert parts[0] == "", result.stdout[:3000]
    runs = dict(part.split("\n", 1) for part in parts[1:])
    assert sorted(runs) == sorted(layouts), result.stdout[:3000]
    return {name: json.loads(out) for name, out in runs.items()}


@pytest.fixture(scope="module")
def dry_ep(dry_runs):
    return dry_runs["ep"]


@pytest.fixture(scope="module")
def dry_dp(dry_runs):
    return dry_runs["dp"]


def test_dry_run_json_has_every_category(dry_ep):
    assert set(dry_ep["planned"]) == set(CATEGORIES) and set(dry_ep["measured"]) == set(CATEGORIES)
    assert all(dry_ep["measured"][k] > 0 for k in CATEGORIES)
    assert dry_ep["rank"] == 1 and dry_ep["seq_length"] == 64 and dry_ep["layers"] == 2


def test_dry_run_keeps_bfloat16(dry_dp):
    assert dry_dp["compute_dtype"] == "bfloat16"
    assert any("bfloat16" in note for note in dry_dp["notes"]) and not any("float16 (" in n for n in dry_dp["notes"])
    # booked as the CPU stores bf16 (the SwiGLU activations in 2 bytes, the rest fp32) the plan is within
    # 10 % of the measured activations (0.97x, fp32's run 1.03x); booked at 4 bytes, as before, it was
    # 1.24x, and at bf16's 2 bytes throughout (probabilities, weight copies: the unfused plan) 1.98x
    planned, measured = dry_dp["planned"]["activations"], dry_dp["measured"]["activations"]
    assert within(planned, measured, 0.10), (planned, measured)
    assert dry_dp["planned"] == dry_dp["planned_full_config"]     # ran as written: one plan, bf16's


def test_cpu_bf16_plan_books_the_kernels_2_byte_containers():
    """bf16 on the CPU kernels (docs/precision.md): against fp32 the plan differs only by the SwiGLU
    activations the kernels store as 2-byte bf16 containers, 2 bytes an element (the routed experts'
    token rows, gate|up and product; a dense MLP's input, gate|up and product); every other bf16 value,
    what the experts' buffers and the collectives carry, and the weights (no rounded copies) stay fp32's.
    Counted from the config, not the planner's formulas."""
    from moetrain.config import load_config
    from moetrain.layout import Layout
    from moetrain.planner.arch import Job
    from moetrain.planner.costs import plan_layout

    def plans(config):
        out = []
        for dtype in ("float32", "bfloat16"):
            cfg = load_config(config, ["parallel.data_parallel=2", f"precision.compute_dtype={dtype}",
                                       f"parallel.grad_reduce_dtype={dtype}"])
            layout = Layout.of(cfg)
            out.append(plan_layout(Job.of(cfg), layout, "cpu", layout.world).stages[0])
        return cfg, layout, out

    cfg, layout, (fp32, bf16) = plans(TINY)                   # every layer MoE, 8 experts top-2, ep 1
    m, tokens = cfg.model, layout.micro_batch_size * cfg.model.seq_length
    rows = tokens * m.moe.top_k                               # ep 1: exactly the routed rows
    containers = m.num_layers * rows * (m.hidden_size + 3 * m.moe.ffn_hidden_size)
    assert fp32.memory["activations"] - bf16.memory["activations"] == 2 * containers
    assert all(bf16.memory[k] == fp32.memory[k] for k in ("weights", "gradients", "optimizer"))
    assert bf16.dispatch_bytes == fp32.dispatch_bytes and bf16.comm_bytes == fp32.comm_bytes
    assert bf16.comm_bytes["dp"] > 0
    cfg, layout, (fp32, bf16) = plans(os.path.join(ROOT, "configs", "gpt_tiny.yaml"))     # dense
    m, tokens = cfg.model, layout.micro_batch_size * cfg.model.seq_length
    containers = m.num_layers * tokens * (m.hidden_size + 3 * m.ffn_hidden_size)
    assert fp32.memory["activations"] - bf16.memory["activations"] == 2 * containers


def zero_row(params) -> int:
    """Elements of this rank's ZeRO row: each trainable parameter padded to G ceil(n / G)."""
    return sum(math.ceil(n / g) for _, n, g, trainable in params if trainable)


def test_measured_static_bytes_equal_an_independent_count(dry_ep, dry_dp):
    params = local_numels(dp=2, ep=2)
    assert dry_ep["measured"]["weights"] == 4 * sum(n for _, n, _, _ in params)       # fp32 parameters
    # ZeRO-2: fp32 master + AdamW m + v of this rank's row, and its fp32 gradient row
    assert dry_ep["measured"]["optimizer"] == 3 * 4 * zero_row(params)
    assert dry_ep["measured"]["gradients"] == 4 * zero_row(params)
    params = local_numels(dp=2, ep=1, layers=4)
    trainable = sum(n for _, n, _, t in params if t)
    assert dry_dp["measured"]["weights"] == 4 * sum(n for _, n, _, _ in params)
    assert dry_dp["measured"]["optimizer"] == 3 * 4 * zero_row(params)                # ZeRO-1: sharded states
    assert dry_dp["measured"]["gradients"] == 4 * trainable                           # ... whole gradients


def within(planned, measured, bound):
    return abs(planned / measured - 1) <= bound


def test_plan_within_bounds_of_measurement(dry_ep, dry_dp):
    for dry in (dry_ep, dry_dp):
        planned, measured = dry["planned"], dry["measured"]
        static = [sum(d[k] for k in ("weights", "gradients", "optimizer")) for d in (planned, measured)]
        assert within(*static, 0.10), (planned, measured)
    planned, measured = dry_dp["planned"], dry_dp["measured"]
    assert within(planned["activations"], measured["activations"], 0.25), (planned, measured)
    assert within(planned["dispatch_buffers"], measured["dispatch_buffers"], 0.25), (planned, measured)


def test_ep_dispatch_buffers_planned_as_the_dispatcher_sizes_them(dry_ep):
    """dp 2 x ep 2: the all-to-all's buffers are per-destination capacities, the first micro-batch's
    the prior's (2x the even share, + 2 sd, bucketed): the plan books those, within 15 % (issue 32;
    the load-proportional T k x 1.1 it booked before is 0.55x of them here)."""
    planned, measured = dry_ep["planned"]["dispatch_buffers"], dry_ep["measured"]["dispatch_buffers"]
    assert within(planned, measured, 0.15), (planned, measured, dry_ep["detail"])
    assert dry_ep["detail"]["capacities_largest"]["pair_capacity"][1] > 0


def test_capacity_sizes_agree_element_wise_and_import_no_mindspore():
    """The controller sizes whole tables with the numpy forms of `bucket` and `sized`, the planner and
    the dispatchers' scalars with the int forms (moetrain/moe/sizing.py, one module for both, which the
    planner imports without MindSpore)."""
    import subprocess
    import sys

    import numpy as np

    from moetrain.moe.sizing import bucket, bucketed, sized, sized_array

    rows = np.array([1, 7, 16, 17, 31, 100, 511, 512, 513, 4097, 123457, 16777217])
    assert bucketed(rows).tolist() == [bucket(r) for r in rows] == [1, 7, 16, 18, 32, 104, 512, 512, 576, 4608,
                                                                    131072, 18874368]
    assert sized_array(rows).tolist() == [sized(r) for r in rows]
    assert bucket(16.2) == 18 and sized(32) == 44                       # a fractional need rounds up
    code = "import sys, moetrain.moe.sizing, moetrain.planner.costs; print('mindspore' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", out


def plan_in_process(capsys, monkeypatch, *args):
    """(exit status, stderr) of `moetrain plan TINY ARGS` run in this process: for arguments refused before
    any model is built, where a fresh interpreter would cost seconds of imports for nothing."""
    from moetrain.planner import main

    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    status = main([TINY, *args])
    return status, capsys.readouterr().err


def test_bad_rank_is_a_clear_error(capsys, monkeypatch):
    status, err = plan_in_process(capsys, monkeypatch, "--dry-run", "--rank", "2", *EXPERT_PARALLEL)
    assert status == 2
    assert "--rank 2" in err and "ranks 0..1" in err    # ep lies inside dp: 2 ranks


def test_bad_layers_and_sequence_are_clear_errors(capsys, monkeypatch):
    for flag, value, message in (("--layers", "9", "--layers 9: must be in [pipeline stages=1, model.num_layers=2]"),
                                 ("--seq", "999", "--seq 999: must be in [1, model.seq_length=128]")):
        status, err = plan_in_process(capsys, monkeypatch, "--dry-run", flag, value, *EXPERT_PARALLEL)
        assert status == 2 and message in err, err[-2000:]


# Issue 32 item 5: the dry run of moe_tiny at 16 layers, 16 x 64 tokens, once per recompute policy,
# each in a fresh process (a process that compiled one model's step runs a later model's step with
# the first one's recompute marks: measured, docs/parallel_engine.md "Recompute under jit"). About 40 CPU-s,
# so it runs in an idle-priority child beside the suite (tests/background.py).
RECOMPUTE_POLICIES = ("none", "selective", "full")
RECOMPUTE_DRIVER = r"""
import json, subprocess, sys
peaks = {}
for policy in sys.argv[2:]:
    done = subprocess.run([sys.executable, "-m", "moetrain.planner", sys.argv[1], "--dry-run", "--json", "--seq", "64",
                           "--set", "model.num_layers=16", "--set", "parallel.recompute=" + policy],
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(policy + " failed: " + done.stderr[-3000:])
    result = json.loads(done.stdout)
    peaks[policy] = [result["measured"]["activations"], result["planned"]["activations"],
                     result["detail"]["planned_unpacked_gradients"]]
print("PEAKS " + json.dumps(peaks))
"""
run_in_background(__name__, [sys.executable, "-c", RECOMPUTE_DRIVER, TINY, *RECOMPUTE_POLICIES],
                  env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")), cwd=ROOT,
                  timeout=1200, reader="test_recompute_lowers_the_jitted_activation_peak")


def test_recompute_lowers_the_jitted_activation_peak():
    """Recompute lowers the memory pool's peak in the compiled step the trainer runs (the dry run's
    activations, the config's `parallel.recompute` applied by `parallelize`). moe_tiny at 16 layers,
    one micro-batch of 16 x 64 tokens: `full` (whole blocks, MoE blocks included) at most half of
    `none`, `selective` (attention core, routed experts) between them. Measured 148 / 102 / 59 MB;
    with no cell marked, 148 MB all three.

    And the plan of each policy within 15 % of its measurement (issue 32 item 3): selective priced
    as the trainer applies it (the routed experts' intermediates dropped too; priced as the
    attention core alone it planned 146 MB, 1.43x), full at the end of the backward (every
    per-parameter gradient live with its packed copy; without them it planned 20 MB, 0.34x)."""
    done = wait_for_background(__name__)
    assert done.returncode == 0, done.stdout[-3000:]
    result = json.loads(done.stdout.split("PEAKS ")[-1])
    peak = {policy: measured for policy, (measured, _, _) in result.items()}
    assert peak["full"] <= 0.5 * peak["none"], peak
    assert peak["full"] < peak["selective"] < peak["none"], peak
    for policy, (measured, planned, unpacked) in result.items():
        assert within(planned, measured, 0.15), (policy, result)
    assert result["full"][2] > 0 and result["none"][2] == result["selective"][2] == 0, result
